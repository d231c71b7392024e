"""Where a decode step's device time goes: the kernels of a few replays, grouped by kind.

`profile_step(step, repeats)` runs `step` under torch.profiler and returns, per kernel name, its
launches and device time per step, plus the step's span (first kernel start to last kernel end,
per step) and the share of that span no kernel ran in (launch gaps, waits). With
`device="cpu"` the events are the CPU operators instead, so the same code runs in CPU tests.
Under programmatic dependent launch an expand starts before its shrink ends and waits inside,
so kernel times can add up to more than the span.

Kernels inside a CUDA-graph replay are recorded one by one, so a replayed step is broken down
the same way as an eager one. `kind_of` groups names: the LoRA shrink and expand, matmuls,
attention, norms, copies and gathers, other elementwise kernels, and the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KINDS = (("lora_shrink", ("_shrink_kernel",)), ("lora_expand", ("_expand_kernel",)),
         ("lora_fused", ("_fused_kernel",)),
         ("attention", ("attention", "attn", "paged", "flash", "fmha", "sdpa")),
         ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::matmul",
                    "aten::linear")),
         ("norm", ("layer_norm", "rms_norm", "_norm_kernel")),
         # torch.compile's kernels (and our elementwise ones) before the copies: their names list the fused ops
         # ("..._to_copy_add_cat_...")
         ("elementwise", ("triton_poi", "triton_red", "triton_per", "_rotary_qk", "_quick_gelu", "_silu_mul",
                          "_rope_kernel")),
         ("copy", ("memcpy", "memset", "copy_kernel", "index", "cat_", "catarray", "aten::copy_", "aten::cat")),
         ("elementwise", ("elementwise", "vectorized", "reduce_kernel")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, marks in KINDS:
        if any(m.lower() in low for m in marks):
            return kind
    return "other"


def events_of(prof, cuda: bool):
    """A finished profile's kernels (cuda) or outermost CPU operators, without our own annotations
    (`vlora::...` ranges, which span other events' time)."""
    from torch.autograd import DeviceType

    want = DeviceType.CUDA if cuda else DeviceType.CPU
    out = [e for e in prof.events() if e.device_type == want and not e.name.startswith("vlora::")]
    if not cuda:  # CPU operators nest: keep the outermost aten calls' children out of the sum
        out = [e for e in out if e.cpu_parent is None or e.cpu_parent.device_type != want]
    return out


def kernels_of(events, repeats: int = 1) -> list[dict]:
    """[{name, kind, launches, us}] per repeat for each name among `events`, longest first."""
    per_name: dict[str, list[float]] = {}
    for e in events:
        per_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    return sorted(({"name": name, "kind": kind_of(name), "launches": len(d) / repeats, "us": sum(d) / repeats}
                   for name, d in per_name.items()), key=lambda k: -k["us"])


def profile_step(step: Callable[[], None], repeats: int = 10, device: str | None = None) -> dict:
    """{"kernels": [{name, kind, launches, us}] per step (longest first), "span_us", "busy_us",
    "idle_share"}, from `repeats` calls of `step` after one warm-up call. device: whose events
    ("cuda" kernels or "cpu" operators; default cuda where there is one)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() if device is None else device == "cuda"
    step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            step()
        if cuda:
            torch.cuda.synchronize()
    events = events_of(prof, cuda)
    if not events:
        raise RuntimeError("the profiler recorded no kernels; is CUPTI available to torch.profiler?")
    kernels = kernels_of(events, repeats)
    span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) / repeats
    busy = sum(k["us"] for k in kernels)
    return {"kernels": kernels, "span_us": span, "busy_us": busy, "idle_share": max(0.0, 1 - busy / span)}



def profile_on_rank0(step: Callable[[], None], rank: int, repeats: int, cuda: bool) -> dict:
    """profile_step on rank 0 of a group; every other rank makes the same 1 + repeats calls unprofiled, so the
    collectives inside `step` pair up, also when the profiler fails on rank 0 (no CUPTI, say: rank 0 then makes
    the calls it has left). Returns the profile on rank 0, {} elsewhere, {"error": ...} on a failure."""
    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    if rank != 0:
        for _ in range(repeats + 1):
            step()
        sync()
        return {}
    calls = 0

    def counted() -> None:
        nonlocal calls
        calls += 1
        step()

    try:
        return profile_step(counted, repeats=repeats, device="cuda" if cuda else "cpu")
    except Exception as e:
        for _ in range(repeats + 1 - calls):
            step()
        sync()
        return dict(error=f"{type(e).__name__}: {e}")

def by_kind(profile: dict) -> dict[str, dict]:
    """{kind: {"launches", "us"}} per step."""
    out: dict[str, dict] = {}
    for k in profile["kernels"]:
        slot = out.setdefault(k["kind"], {"launches": 0.0, "us": 0.0})
        slot["launches"] += k["launches"]
        slot["us"] += k["us"]
    return out
