"""Where our vision tower's device time goes, and what the candidate speed-ups would buy.

`vlora bench bench.suite=vision bench.vision.profile=true` adds, at `profile_chunks` chunks per tower
call (a served step carries a few chunks' frame groups):
- the tower's kernels by kind (matmul, attention, norm, elementwise, copy, other) and its longest
  kernels, eager and with the compiled elementwise chains (`bench.step_profile`), per chunk;
- the batched attention under each of PyTorch's fused SDPA backends (flash, cuDNN, memory-efficient):
  the head size of the Qwen towers (80) is not one every backend serves at its best;
- the whole tower replayed as one CUDA graph: what the host's launches cost on top of the kernels;
- the rotary and quick_gelu chains alone: eager, torch.compile's kernel and our Triton kernels;
- each linear's GEMM alone at the call's row count, bf16 and FP8 (the activation's per-row
  quantization included, as `fp8_linear` runs it; where K and N are multiples of 16), with the
  achieved TFLOP/s.
On the CPU only the kinds (of CPU operators) and the bf16 GEMMs are measured; the rest is None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .step_profile import by_kind, profile_step

BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def linear_shapes(tower) -> list[tuple[str, int, int, int]]:
    """(name, rows factor, K, N) of the tower's distinct linears: rows factor 1 for the blocks' and the
    patch embedding's, 1 / merge^2 for the merger's (it runs on merged rows)."""
    block = tower.blocks[0]
    shapes, seen = [], set()
    for name, module in block.named_modules():
        if isinstance(module, torch.nn.Linear) and (module.in_features, module.out_features) not in seen:
            seen.add((module.in_features, module.out_features))
            shapes.append((name, 1, module.in_features, module.out_features))
    shapes.append(("patch_embed", 1, tower.patch_embed.proj.weight[0].numel(), tower.patch_embed.proj.weight.shape[0]))
    for i, layer in enumerate(m for m in tower.merger.mlp if isinstance(m, torch.nn.Linear)):
        shapes.append((f"merger.{i}", tower.merge ** 2, layer.in_features, layer.out_features))
    return shapes


def _gemms(tower, rows: int, time_ms: Callable[[Callable], float]) -> list[dict]:
    weight = tower.patch_embed.proj.weight
    device, dtype = weight.device, weight.dtype
    fp8 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    out = []
    for name, per, k, n in linear_shapes(tower):
        m = rows // per
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype) / k ** 0.5
        b = torch.zeros(n, device=device, dtype=dtype)
        flop = 2 * m * k * n
        row = {"linear": name, "m": m, "k": k, "n": n, "bf16_ms": time_ms(lambda: torch.nn.functional.linear(x, w, b))}
        row["bf16_tflops"] = flop / (row["bf16_ms"] * 1e-3) / 1e12
        row["fp8_ms"] = row["fp8_tflops"] = None
        if fp8 and k % 16 == 0 and n % 16 == 0:  # _scaled_mm's operands (the patch embedding's K=1176 is not)
            from vlora_kernels.fp8 import fp8_linear, quantize_weight

            q, s = quantize_weight(w)
            row["fp8_ms"] = time_ms(lambda: fp8_linear(x, q, s, b))
            row["fp8_tflops"] = flop / (row["fp8_ms"] * 1e-3) / 1e12
        out.append(row)
    return out


def _chains(tower, rows: int, time_ms: Callable[[Callable], float]) -> dict:
    """ms per tower call of the rotary and the quick_gelu chains (x the blocks): eager, torch.compile's
    kernel (dynamic rows, as the tower ran it before) and ours (`serve.models.vision_fused`)."""
    from serve.models.qwen_vision import _quick_gelu, _rotary_qk
    from serve.models.vision_fused import quick_gelu, rotary_qk

    weight = tower.patch_embed.proj.weight
    heads, dim = tower.heads, weight.shape[0] // tower.heads
    qkv = torch.randn(rows, 3, heads, dim, device=weight.device, dtype=weight.dtype)
    cos, sin = tower.rotary(torch.randint(0, 64, (rows, 2), device=weight.device))
    hidden = tower.blocks[0].mlp.fc1.out_features if hasattr(tower.blocks[0].mlp, "fc1") else None
    depth, out = len(tower.blocks), {}
    cases = {"rotary": ((qkv, cos, sin), _rotary_qk, rotary_qk)}
    if hidden is not None:
        cases["quick_gelu"] = ((torch.randn(rows, hidden, device=weight.device, dtype=weight.dtype),),
                               _quick_gelu, quick_gelu)
    for name, (args, reference, ours) in cases.items():
        compiled = torch.compile(reference, dynamic=True)
        for variant, fn in (("eager", reference), ("inductor", compiled), ("triton", ours)):
            out[f"{name}_{variant}"] = time_ms(lambda: fn(*args)) * depth
    return out


def _graph_ms(call: Callable[[], object], time_ms: Callable[[Callable], float]) -> float:
    """ms of one replay of `call` captured as a CUDA graph (after a warm call on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return time_ms(graph.replay)


def _kinds(step: Callable[[], object], chunks: int, repeats: int) -> dict:
    prof = profile_step(step, repeats=repeats)
    return {"span_ms": prof["span_us"] / 1e3 / chunks, "busy_ms": prof["busy_us"] / 1e3 / chunks,
            "idle_share": prof["idle_share"],
            "kinds_ms": {kind: v["us"] / 1e3 / chunks for kind, v in by_kind(prof).items()},
            "launches": sum(k["launches"] for k in prof["kernels"]),
            "top": [{"name": k["name"][:100], "kind": k["kind"], "launches": k["launches"],
                     "ms": k["us"] / 1e3 / chunks} for k in prof["kernels"][:12]]}


def profile_tower(tower, pixels: torch.Tensor, grids, chunks: int, repeats: int,
                  time_ms: Callable[[Callable], float]) -> dict:
    """The profile described above for one tower call on `pixels` (`chunks` chunks' frame groups); every
    time per chunk. `time_ms(fn)`: the median ms of one call of fn. The tower's settings are restored."""
    cuda = pixels.is_cuda
    saved = tower.attention, tower.compiled
    layout = tower.layout(grids)

    def call():
        return tower(pixels, layout)

    result: dict = {"chunks": chunks, "rows": pixels.shape[0]}
    try:
        tower.attention = "batched"
        for compiled in ((False, True) if cuda else (False,)):
            tower.compiled = compiled
            result["compiled" if compiled else "eager"] = _kinds(call, chunks, repeats)
        result["sdpa_ms"] = {}
        if cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            for backend in BACKENDS:
                try:
                    with sdpa_kernel(getattr(SDPBackend, backend)):
                        result["sdpa_ms"][backend.lower()] = time_ms(call) / chunks
                except RuntimeError as e:  # the backend cannot serve this shape or GPU
                    result["sdpa_ms"][backend.lower()] = f"{type(e).__name__}: {str(e)[:120]}"
            for compiled in (False, True):
                tower.compiled = compiled
                try:
                    result[f"graph_{'compiled' if compiled else 'eager'}_ms"] = _graph_ms(call, time_ms) / chunks
                except Exception as e:  # noqa: BLE001 - a capture failure is a result, not a crash of the suite
                    result[f"graph_{'compiled' if compiled else 'eager'}_ms"] = f"{type(e).__name__}: {str(e)[:120]}"
            result["chains_ms"] = {k: v / chunks for k, v in _chains(tower, pixels.shape[0], time_ms).items()}
        result["gemms"] = _gemms(tower, pixels.shape[0], time_ms)
    finally:
        tower.attention, tower.compiled = saved
    return result


def profile_lines(result: dict) -> list[str]:
    """The profile as printed lines (the JSON holds everything)."""
    lines = []
    for variant in ("eager", "compiled"):
        if variant in result:
            p = result[variant]
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(p["kinds_ms"].items(), key=lambda kv: -kv[1]))
            lines.append(f"[vision profile] {variant}: span {p['span_ms']:.2f} ms/chunk, busy {p['busy_ms']:.2f} "
                         f"({kinds}), {p['launches']:.0f} launches per call")
    for name, ms in result.get("sdpa_ms", {}).items():
        lines.append(f"[vision profile] sdpa {name}: {ms:.2f} ms/chunk" if isinstance(ms, float)
                     else f"[vision profile] sdpa {name}: {ms}")
    for key in ("graph_eager_ms", "graph_compiled_ms"):
        if key in result:
            v = result[key]
            lines.append(f"[vision profile] {key}: " + (f"{v:.2f} ms/chunk" if isinstance(v, float) else str(v)))
    for name, ms in result.get("chains_ms", {}).items():
        lines.append(f"[vision profile] {name}: {ms:.2f} ms/chunk (all blocks)")
    for g in result.get("gemms", []):
        fp8 = f", fp8 {g['fp8_ms']:.3f} ms {g['fp8_tflops']:.0f} TFLOP/s" if g["fp8_ms"] is not None else ""
        lines.append(f"[vision profile] gemm {g['linear']} {g['m']}x{g['k']}x{g['n']}: bf16 {g['bf16_ms']:.3f} ms "
                     f"{g['bf16_tflops']:.0f} TFLOP/s{fp8}")
    return lines
