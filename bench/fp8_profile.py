"""Where the FP8 suite's decode step spends its time (`bench.fp8.profile=true`): per precision and batch
size, a few decode steps under torch.profiler (bench/step_profile.py), after and apart from the timed runs.

On a GPU the step profiled is the one `decode_step_ms` times (the engine's CUDA-graph replay plus the
LM head; the graph's kernels are recorded one by one); on the CPU it is `Engine.step()` on a batch
that is decoding (the CPU operators), which exercises the same code at the tiny shape. Each profile
writes profile_<precision>_b<batch>.csv (kernel, kind, calls, total_us, share of the step) and one
`section="profile"` row: the step's span, how much of it no kernel ran (launch gaps), and the time
per kind. Kinds (`kind_of`): gemm (projections, LM head: cuBLAS/CUTLASS/nvjet, `_scaled_mm`),
quantize (per-token FP8 quantization, alone or fused into a norm or the SiLU-mul), attention,
lora, norm, and other (RoPE, SiLU-mul, copies, sampling).
"""

from __future__ import annotations

import math
from pathlib import Path

from serve.engine import Engine, Request, SamplingParams

from .engine import _prompts, replay_step
from .results import write_csv
from .step_profile import profile_step

KINDS = (("quantize", ("quantize", "fp8_quant", "_fp8_kernel")),  # first: the fused norm + quantize counts here
         ("lora", ("_shrink_kernel", "_expand_kernel", "_fused_kernel", "lora")),
         ("attention", ("attention", "attn", "paged", "flash")),
         # cuBLAS at a few rows may pick a gemv or a split-K GEMM with its reduction kernel
         ("gemm", ("gemm", "gemv", "splitk", "nvjet", "cutlass", "xmma", "cublas", "scaled_mm", "f8f8bf16",
                   "aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm")),
         ("norm", ("rms_norm", "rmsnorm")))
KIND_NAMES = ("gemm", "quantize", "attention", "lora", "norm", "other")  # the report's order


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, marks in KINDS:
        if any(m in low for m in marks):
            return kind
    return "other"


def _engine_step(engine: Engine, job, batch: int, steps: int):
    """A callable running one engine step of `batch` decoding sequences (the CPU's decode step), and a
    function that finishes them. Each sequence is given tokens for `steps` calls and the prefill."""
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True, detokenize=False)
    for text, image in _prompts(job, engine.tokenizer, batch, 5000 + 1000 * batch):
        engine.add_request(Request(prompt=text, images=[image], sampling=params))
    for _ in range(16):  # prefill (maybe chunked) until a decode-only step ran
        engine.step()
        if engine.step_log and engine.step_log[-1][2]:
            break
    else:
        raise RuntimeError(f"batch {batch}: no decode-only step after 16 steps; the profile would time prefill")

    def drain():
        while engine.has_unfinished():
            engine.step()

    return engine.step, drain


def profile_decode(engine: Engine, job, name: str, out: Path) -> list[dict]:
    """One `section="profile"` row per batch size; writes out/profile_<name>_b<batch>.csv."""
    cuda = engine.runner.graphs is not None
    rows = []
    for b in job.batch_sizes:
        if cuda:
            step, drain = replay_step(engine, b, [job.decode_context] * b), (lambda: None)
        else:
            step, drain = _engine_step(engine, job, b, job.profile_repeats + 1)
        try:
            prof = profile_step(step, repeats=job.profile_repeats, device="cuda" if cuda else "cpu")
        finally:
            drain()
        span = prof["span_us"]
        kernels = [dict(kernel=k["name"], kind=kind_of(k["name"]), calls=k["launches"], total_us=k["us"],
                        share=k["us"] / span if span > 0 else float("nan")) for k in prof["kernels"]]
        write_csv(out / f"profile_{name}_b{b}.csv", kernels)
        row = dict(section="profile", precision=name, batch=b, step="graph replay + LM head" if cuda else "engine step",
                   span_us=span, busy_us=prof["busy_us"], idle_share=prof["idle_share"],
                   launches=sum(k["calls"] for k in kernels))
        for kind in KIND_NAMES:
            of_kind = [k for k in kernels if k["kind"] == kind]
            row[f"{kind}_us"] = sum(k["total_us"] for k in of_kind)
            row[f"{kind}_calls"] = sum(k["calls"] for k in of_kind)
        row["top"] = "; ".join(f"{_short(k['kernel'])} x{k['calls']:g} {k['total_us']:.0f}us" for k in kernels[:3])
        rows.append(row)
    return rows


def _short(name: str, width: int = 48) -> str:
    name = name.replace("|", "/")  # a Markdown table cell
    return name if len(name) <= width else name[:width - 3] + "..."


def profile_lines(rows: list[dict]) -> list[str]:
    """fp8.md's section: per precision and batch, the step's span, idle share, and time per kind."""
    prof = [r for r in rows if r["section"] == "profile"]
    if not prof:
        return []
    cols = ("precision", "batch", "span_us", "idle", *KIND_NAMES)
    lines = ["", f"## Decode step profile ({prof[0]['step']}; us per step, share of the span)", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in prof:
        span = r["span_us"]

        def cell(kind):
            us = r[f"{kind}_us"]
            return f"{us:.0f} ({us / span:.0%}, {r[f'{kind}_calls']:g} calls)" if span > 0 and us else "0"

        idle = f"{r['idle_share']:.0%}" if math.isfinite(r["idle_share"]) else ""
        lines.append("| " + " | ".join([r["precision"], str(r["batch"]), f"{span:.0f}", idle]
                                       + [cell(k) for k in KIND_NAMES]) + " |")
    lines += ["", "Top kernels (per step):", ""]
    lines += [f"- {r['precision']} b{r['batch']}: {r['top']}" for r in prof]
    lines += ["", "Per kernel: profile_<precision>_b<batch>.csv. A fused norm + quantize kernel counts as quantize."]
    return lines
