"""The FP8 suite's projection GEMMs alone (`bench.fp8.gemm=true`): per projection shape of the model and
per batch size (rows M), the bf16 `F.linear` against FP8's parts, to say whether the FP8 decode step
is slow in its GEMMs themselves or around them.

    bf16_us       F.linear(x, W)                                  bf16 weight, 2 bytes a value
    fp8_us        fp8_linear(x, q_W, s_W): quantize x + _scaled_mm  what an unfused projection runs
    fp8_gemm_us   fp8_linear's GEMM alone (x quantized beforehand)  what a fused projection runs
    plain_us      torch._scaled_mm(q_x, q_W.T) alone                the GEMM as written
    swap_us       the same GEMM transposed (transposed_scaled_mm), timed at every size: tried as the decode
                  path and measured slower (results/fp8/nvidia_h200/third_run/), kept as this A/B
    triton_us     vlora_kernels/fp8_decode.py's Triton GEMM (weight tiled by channels, split-K): what fp8_linear
                  runs at 1..DECODE_KERNEL_MAX_M tokens (VLORA_FP8_DECODE_MAX_M); timed at every size up
                  to its MAX_M (64), NaN above, and NaN on the CPU unless Triton interprets (TRITON_INTERPRET=1)
    w8a16_us      vlora_kernels/fp8_decode.py's weight-only GEMM (fp8w_decode_mm): the bf16 x as it is times the FP8
                  weight widened in registers, nothing quantized; timed where triton_us is. fp8_linear runs it
                  at decode sizes when vlora_kernels.fp8.DECODE_ACTIVATIONS is "bf16"
    quantize_us   quantize_rows(x) alone

and each GEMM's weight bandwidth (weight bytes / time, TB/s: bf16_tb_s, fp8_tb_s of fp8_gemm_us,
triton_tb_s): at decode a projection should be bound by reading its weight, so FP8 should take half
of bf16's time. Each call reads the next of enough weight copies to pass 256 MB, so no call finds its
weight in L2 (50-60 MB on Hopper). fp8_gemm_us is the GEMM fp8_linear would pick: w8a16_us (or triton_us,
as DECODE_ACTIVATIONS says) at 1..DECODE_KERNEL_MAX_M tokens on a GPU, else plain_us.
On a GPU each is `vlora_kernels.timing.time_op` (CUDA graphs, events); on the CPU a wall-clock median
of the same calls at the tiny shape (the code path, not a speed).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vlora_kernels import fp8 as fp8_kernels
from vlora_kernels.fp8 import DECODE_KERNEL_MAX_M, FP8_DTYPE, fp8_linear, quantize_rows, quantize_weight, scaled_mm_rows
from vlora_kernels.fp8_decode import MAX_M as DECODE_MAX_M
from vlora_kernels.fp8_decode import fp8_decode_mm, fp8w_decode_mm
from vlora_kernels.interpreter import interpreted

L2_PASS_BYTES = 256 << 20


def projection_shapes(args) -> dict[str, tuple[int, int]]:
    """projection -> (N out, K in), as serve/models/decoder.py builds them."""
    i = args.intermediate_size
    return {"qkv_proj": (args.q_size + 2 * args.kv_size, args.hidden_size), "o_proj": (args.hidden_size, args.q_size),
            "gate_up_proj": (2 * i, args.hidden_size), "down_proj": (args.hidden_size, i)}


def _timer(cuda: bool) -> Callable[[Callable[[], object]], float]:
    if cuda:
        from vlora_kernels.timing import time_op

        return lambda fn: time_op(fn, warmup=5, repeats=30)

    def wall(fn) -> float:
        fn()
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(runs)

    return wall


def transposed_scaled_mm(q_x: torch.Tensor, s_x: torch.Tensor, q_weight: torch.Tensor,
                         weight_scale: torch.Tensor) -> torch.Tensor:
    """vlora_kernels.fp8.scaled_mm_rows transposed: y.T = q_weight @ q_x.T, the scales' roles swapped, so the weight's
    output channels fill cuBLAS's 128-row tiles at decode sizes. The tokens are then _scaled_mm's second
    operand, whose both sizes must be multiples of 16: rows padded with zeros (scale 1), extra columns dropped.
    On an H200 cuBLAS picked the same kernel either way and the copies cost 6-10 us a projection."""
    m, k = q_x.shape
    rows = max(16, -(-m // 16) * 16)
    q_p = torch.zeros((rows, k), dtype=torch.uint8, device=q_x.device)  # zeros by bytes: fp8 has no fill
    q_p[:m] = q_x.view(torch.uint8)
    s_p = torch.ones((rows, 1), dtype=torch.float32, device=s_x.device)
    s_p[:m] = s_x
    y_t = torch._scaled_mm(q_weight, q_p.view(FP8_DTYPE).t(), scale_a=weight_scale.view(-1, 1),
                           scale_b=s_p.view(1, -1), out_dtype=torch.bfloat16)
    return y_t[:, :m].t().contiguous()


def _cycle(items: list):
    state = {"i": -1}

    def next_item():
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]

    return next_item


def gemm_rows(args, batch_sizes, device: str, seed: int = 0) -> list[dict]:
    """One `section="gemm"` row per projection shape and batch size."""
    cuda = torch.device(device).type == "cuda"
    timed = _timer(cuda)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for name, (n, k) in projection_shapes(args).items():
        copies = max(1, -(-L2_PASS_BYTES // (n * k)))  # the FP8 weight's bytes; bf16's are twice as many
        if not cuda:
            copies = 1
        w = [(torch.randn(n, k, generator=g) * 0.02).to(device, torch.bfloat16) for _ in range(copies)]
        q = [quantize_weight(x) for x in w]
        next_w, next_q = _cycle(w), _cycle(q)
        for m in batch_sizes:
            x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
            q_x, s_x = quantize_rows(x)

            def gemm(fn):
                return lambda: fn(q_x, s_x, *next_q())

            bf16_us = timed(lambda: F.linear(x, next_w()))
            fp8_us = timed(lambda: fp8_linear(x, *next_q()))
            plain_us, swap_us = timed(gemm(scaled_mm_rows)), timed(gemm(transposed_scaled_mm))
            decode = 0 < m <= DECODE_MAX_M and (cuda or interpreted())
            triton_us = timed(lambda: fp8_decode_mm(q_x, s_x, *next_q())) if decode else float("nan")
            w8a16_us = timed(lambda: fp8w_decode_mm(x, *next_q())) if decode else float("nan")
            gemm_us = plain_us
            if cuda and 0 < m <= DECODE_KERNEL_MAX_M:  # fp8_linear's choice on a GPU
                gemm_us = w8a16_us if fp8_kernels.DECODE_ACTIVATIONS == "bf16" else triton_us
            quant_us = timed(lambda: quantize_rows(x))
            rows.append(dict(section="gemm", projection=name, m=m, n=n, k=k, bf16_us=bf16_us, fp8_us=fp8_us,
                             fp8_gemm_us=gemm_us, plain_us=plain_us, swap_us=swap_us, triton_us=triton_us,
                             w8a16_us=w8a16_us, quantize_us=quant_us, gemm_speedup=bf16_us / gemm_us,
                             bf16_tb_s=2 * n * k / bf16_us / 1e6, fp8_tb_s=n * k / gemm_us / 1e6,
                             triton_tb_s=n * k / triton_us / 1e6, w8a16_tb_s=n * k / w8a16_us / 1e6,
                             weight_copies=copies))
        del w, q
    return rows


def gemm_lines(rows: list[dict], layers: int) -> list[str]:
    """fp8.md's section: the GEMM table and, per batch size, a step's projections summed over the layers."""
    gemm = [r for r in rows if r["section"] == "gemm"]
    if not gemm:
        return []
    cols = ("projection", "m", "n", "k", "bf16_us", "fp8_us", "fp8_gemm_us", "plain_us", "swap_us", "triton_us",
            "w8a16_us", "quantize_us", "gemm_speedup", "bf16_tb_s", "fp8_tb_s", "triton_tb_s", "w8a16_tb_s")
    lines = ["", "## Projection GEMMs alone (us; weight TB/s)", "", "| " + " | ".join(cols) + " |",
             "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |"
              for r in gemm]
    lines.append("")
    for m in dict.fromkeys(r["m"] for r in gemm):
        at = [r for r in gemm if r["m"] == m]
        bf16, fp8, mm, plain, tri, wo = (layers * sum(r[c] for r in at) / 1e3 for c in
                                         ("bf16_us", "fp8_us", "fp8_gemm_us", "plain_us", "triton_us", "w8a16_us"))
        lines.append(f"- batch {m}: the {layers} layers' projections take {bf16:.3g} ms in bf16, {fp8:.3g} ms in "
                     f"FP8 quantizing each input, {mm:.3g} ms in FP8 GEMMs alone ({plain:.3g} ms in _scaled_mm, "
                     f"{tri:.3g} ms in the Triton decode GEMM, {wo:.3g} ms in its weight-only form on bf16 inputs)")
    return lines
