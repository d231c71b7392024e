"""FP8 (float8_e4m3fn) linear algebra for the language model's projections: quantize, dequantize, GEMM, merge.

    weight:  q_w [N, K] fp8, s_w [N] fp32     W ~= q_w * s_w[:, None]   (per output channel, once at load)
    x:       q_x [M, K] fp8, s_x [M, 1] fp32  x ~= q_x * s_x            (per token, every forward, unless
                                                                        x's producer attached them: attach_rows)
    y = fp8_linear(x, q_w, s_w) = (q_x @ q_w.T) * s_x * s_w[None, :]    (torch._scaled_mm, rowwise scales)

A scale is amax / 448 (the largest finite e4m3 value), floored at SCALE_FLOOR so that an all-zero row
gets a finite, positive scale and quantizes to zeros. Values are divided by the scale, clamped to
+-448 (e4m3fn has no infinity: an out-of-range cast would give NaN) and rounded to nearest even.

The per-token quantization is one Triton launch on a GPU (`quantize_rows`: amax of the row, the
scale, the cast, from one read of a row of up to 8192 values, else in two sweeps); `quantize_rows_ref` is the same arithmetic in PyTorch
(several kernels), the CPU path and the test oracle. Nothing here syncs with the host or branches
on tensor values, so the forward can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_decode import (MAX_M, decode_activations, decode_kernel_on, decode_max_m, dequantize_rows, fp8_decode_mm,
                         fp8w_decode_mm, group_scales_fit)
from .interpreter import gdc_launch_dependents, interpreted, pdl_available, quotient_rn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_FLOOR = 1e-12
ONE_PASS_MAX = 8192  # quantize_rows_triton keeps rows up to this long in registers (one read)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    # divided by a tensor, not the Python number: on a GPU PyTorch divides by a host scalar as a
    # multiplication by its rounded reciprocal, which differs from IEEE division (the kernel's div_rn)
    # in the last bit of some scales (seen on an H200)
    amax = amax.float()
    return (amax / torch.full_like(amax, FP8_MAX)).clamp_min(SCALE_FLOOR)


def _cast(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (values.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [..., N, K] float -> (q [..., N, K] fp8, scale [..., N] fp32), one scale per output row."""
    scale = _scale_of(weight.abs().amax(dim=-1))
    return _cast(weight, scale.unsqueeze(-1)), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q: [..., N, K] fp8, scale: [..., N] -> [..., N, K] fp32."""
    return q.float() * scale.unsqueeze(-1)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] -> (q [M, K] fp8, scale [M, 1] fp32): one scale per token (row)."""
    scale = _scale_of(x.abs().amax(dim=-1, keepdim=True))
    return _cast(x, scale), scale


@triton.jit
def quantize_row(y, q_row, s_ptr, offs, mask, FP8_LIMIT: tl.constexpr, FLOOR: tl.constexpr):
    # y: the row as written (model dtype), as float32; masked lanes hold 0 and do not move the amax. The one-pass
    # quantize_rows below, the fused producers (vlora_kernels/fp8_fused.py) and the decode attention's per-(token,
    # kv head) groups (serve/forward/decode_kernel.py)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), FP8_LIMIT), FLOOR)
    tl.store(s_ptr, scale)
    q = tl.minimum(tl.maximum(quotient_rn(y, scale), -FP8_LIMIT), FP8_LIMIT)
    tl.store(q_row + offs, q.to(q_row.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                          FP8_LIMIT: tl.constexpr, FLOOR: tl.constexpr, BLOCK_K: tl.constexpr,
                          ONE_PASS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr):
    # grid: (M,): one program per row. ONE_PASS (K <= BLOCK_K): the row is loaded once and kept in
    # registers; else sweep 1 finds the row's amax and sweep 2 (from L2) casts it.
    if LAUNCH_DEPENDENTS:  # the FP8 GEMM behind may launch now and prefetch its weight (vlora_kernels/fp8_decode.py)
        gdc_launch_dependents()
    pid_m = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + pid_m * stride_xm
    if ONE_PASS:
        mask = offs_k < K
        x = tl.load(x_row + offs_k, mask=mask, other=0.0).to(tl.float32)
        quantize_row(x, q_ptr + pid_m * stride_qm, s_ptr + pid_m, offs_k, mask, FP8_LIMIT, FLOOR)
        return
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs_k < K
        x = tl.load(x_row + k0 + offs_k, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # div_rn: IEEE division as torch's (a plain `/` may lower to the GPU's approximate division)
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_LIMIT), FLOOR)
    tl.store(s_ptr + pid_m, scale)
    q_row = q_ptr + pid_m * stride_qm
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs_k < K
        x = tl.load(x_row + k0 + offs_k, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(quotient_rn(x, scale), -FP8_LIMIT), FP8_LIMIT)
        tl.store(q_row + k0 + offs_k, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_ref` in one Triton launch. x: [M, K] fp16/bf16/fp32, rows contiguous."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x dtype must be float16, bfloat16 or float32, got {x.dtype}")
    m, k = x.shape
    # The interpreter rounds float32 -> e4m3 wrongly (seen in Triton 3.8: 125.4 -> 64, ties away
    # from even), so there the kernel writes the clamped float32 values and torch casts them with
    # round-to-nearest-even, which is what the GPU's cvt.rn does.
    cast_here = interpreted()
    q = torch.empty((m, k), dtype=torch.float32 if cast_here else FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q.to(FP8_DTYPE), scale
    # a row of up to ONE_PASS_MAX values (the hidden size, 3584 on the 7B: o_proj's input) is read once;
    # longer rows (an unfused down_proj's 18944) in two sweeps of 2048
    one_pass = triton.next_power_of_2(k) <= ONE_PASS_MAX
    block_k = max(16, triton.next_power_of_2(k)) if one_pass else 2048
    _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_LIMIT=FP8_MAX, FLOOR=SCALE_FLOOR,
                                BLOCK_K=block_k, ONE_PASS=one_pass, LAUNCH_DEPENDENTS=pdl_available(x.device),
                                num_warps=4 if block_k <= 1024 else 8)
    return (q.to(FP8_DTYPE) if cast_here else q), scale


_ROWS_ATTR = "fp8_rows"


def attach_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Lets x carry its own per-token quantization (`quantize_rows(x)`'s (q, scale)), written by the
    kernel that produced x (vlora_kernels/fp8_fused.py), so `fp8_linear(x, ...)` launches no quantization.
    scale may also be [M, G]: one per token and group of K / G consecutive columns (the decode attention's
    rows, one group per kv head: serve/forward/decode_kernel.py), which only the decode GEMM takes.
    x may be [M, ...]: q is then its rows flattened, [M, K]. It is an attribute of this tensor object only:
    a view, a copy or any op's result has none, and LoRA wrappers pass the same object to their base projection."""
    m = x.shape[0]
    k = x[0].numel() if m else q.shape[-1]
    if (q.shape != (m, k) or scale.dim() != 2 or scale.shape[0] != m or not scale.shape[1]
            or k % scale.shape[1]):
        raise ValueError(f"FP8 rows {tuple(q.shape)} / scales {tuple(scale.shape)} do not fit x {tuple(x.shape)}")
    setattr(x, _ROWS_ATTR, (q, scale))
    return x


def attached_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    return x.__dict__.get(_ROWS_ATTR)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization: the Triton kernel on a GPU, PyTorch elsewhere."""
    if x.is_cuda and x.stride(-1) == 1:
        return quantize_rows_triton(x)
    with torch.profiler.record_function("fp8_quantize_rows"):  # a CPU profile shows its several ops as one
        return quantize_rows_ref(x)


# Tokens up to which fp8_linear runs vlora_kernels/fp8_decode.py's Triton GEMM on a GPU (the weight tiled by
# output channels, the tokens padded to 16-64): all of 1..64, since on an H200 it beat _scaled_mm at 1, 32
# and 64 tokens, per projection and over the whole decode step (results/fp8/nvidia_h200/fourth_run);
# on Hopper only unless VLORA_FP8_DECODE_MAX_M (0..64, read here once) is set, which overrides both.
DECODE_KERNEL_MAX_M = decode_max_m(MAX_M)
# What that kernel multiplies the FP8 weight by: "fp8", the activation quantized per token (fp8_decode_mm), or
# "bf16", the activation as it is (fp8w_decode_mm; nothing is quantized per token at decode sizes, so the norms
# and the SiLU-mul before the projections write no FP8 rows there: `rows_wanted`). "fp8" by measurement: on an
# H200 the weight-only form's widening in registers made its GEMMs 2x slower and the 7B decode step at batch 32
# 5.58 ms against 3.81, for a logit error against fp32 only 4% lower (results/fp8/nvidia_h200/weight_only/).
# VLORA_FP8_DECODE_ACTIVATIONS overrides it, read here once.
DECODE_ACTIVATIONS = decode_activations("fp8")
_decode_kernel_devices: dict[int, bool] = {}


def _decode_kernel_here(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _decode_kernel_devices:  # once per GPU: fp8_linear runs 4 times a layer
        _decode_kernel_devices[index] = decode_kernel_on(torch.cuda.get_device_capability(index))
    return _decode_kernel_devices[index]


def _decode_sized(x: torch.Tensor) -> bool:
    """Whether fp8_linear(x) runs the decode GEMM (vlora_kernels/fp8_decode.py) rather than `_scaled_mm` or the CPU path."""
    return x.is_cuda and 0 < x.shape[0] <= DECODE_KERNEL_MAX_M and _decode_kernel_here(x.device)


def _weight_only(x: torch.Tensor) -> bool:
    """Whether fp8_linear multiplies x as it is (fp8w_decode_mm) rather than its FP8 rows."""
    return (DECODE_ACTIVATIONS == "bf16" and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(-1) == 1 and _decode_sized(x))


def rows_wanted(x: torch.Tensor) -> bool:
    """Whether a projection's fp8_linear(x) reads x's per-token FP8 rows: a fused producer (vlora_kernels/fp8_fused.py)
    writes them beside x only then. x: the producer's input, of the same tokens and dtype as its output."""
    return not _weight_only(x)


def group_rows_read(x: torch.Tensor) -> bool:
    """Whether fp8_linear reads FP8 rows with per-group scales attached to an activation of x's tokens (x: that
    activation or its producer's input): only the decode GEMM takes them, on the FP8 activations it runs on by
    default. The projection's shape is checked once, where the producer is switched on (`group_scales_fit`)."""
    return DECODE_ACTIVATIONS == "fp8" and _decode_sized(x)


def scaled_mm_rows(q_x: torch.Tensor, s_x: torch.Tensor, q_weight: torch.Tensor,
                   weight_scale: torch.Tensor) -> torch.Tensor:
    """(q_x @ q_weight.T) * s_x * weight_scale on a GPU, bf16 [M, N]: `torch._scaled_mm` with rowwise scales."""
    return torch._scaled_mm(q_x, q_weight.t(), scale_a=s_x, scale_b=weight_scale.view(1, -1), out_dtype=torch.bfloat16)


def fp8_linear(x: torch.Tensor, q_weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequantize(q_weight, weight_scale).T (+ bias), with x quantized per token on the fly.

    x: [M, K]; q_weight: [N, K] fp8 (row-major, so .T is the column-major operand _scaled_mm wants);
    weight_scale: [N] fp32. Returns [M, N] in x's dtype. On a GPU the rowwise-scaled GEMM writes
    bf16 (the only output it supports with rowwise scales), cast to x's dtype if that differs; at
    1..DECODE_KERNEL_MAX_M tokens on Hopper (or any GPU where VLORA_FP8_DECODE_MAX_M is set) it is
    vlora_kernels/fp8_decode.py's Triton GEMM instead. On the CPU (tests only: the engine refuses FP8 there) it is the fp32 product of
    the dequantized operands, since CPU `_scaled_mm` takes rowwise scales in some torch releases and not
    in others.
    """
    if _weight_only(x):
        y = fp8w_decode_mm(x, q_weight, weight_scale)
        return y if bias is None else y + bias
    decode = _decode_sized(x)
    rows = attached_rows(x)  # written beside x by its producer, or quantized here
    if rows is not None and rows[1].shape[1] > 1 and x.is_cuda and not (
            decode and group_scales_fit(q_weight.shape[0], q_weight.shape[1], rows[1].shape[1])):
        rows = None  # per-group scales, which only the decode GEMM takes: one scale per token instead
    q_x, s_x = rows or quantize_rows(x)
    if decode:  # the bias is added in the GEMM's epilogue, in fp32
        y = fp8_decode_mm(q_x, s_x, q_weight, weight_scale, bias=bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)
    if x.is_cuda:
        y = scaled_mm_rows(q_x, s_x, q_weight, weight_scale)
    else:
        with torch.profiler.record_function("fp8_scaled_mm"):  # a CPU profile shows the GEMM's ops as one
            y = dequantize_rows(q_x, s_x) @ dequantize(q_weight, weight_scale).T
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y if bias is None else y + bias


def merge_fp8_ref_(weight: torch.Tensor, weight_scale: torch.Tensor, lora_a, lora_b, slot: int, ranks, scales,
                   slice_offsets) -> None:
    """Folds pool slot `slot` into FP8 weights, in place, with fresh per-channel scales:

        for l in range(L):
            W = dequantize(weight[l], weight_scale[l])                       # fp32 [N_total, K]
            W[lo:hi] += scales[slot] * lora_b[l, slot, lo:hi, :r] @ lora_a[l, i, slot, :r]   per slice i
            weight[l], weight_scale[l] = quantize_weight(W)

    weight: [L, N_total, K] fp8; weight_scale: [L, N_total] fp32; the pool tensors as in
    vlora_kernels.merge_lora_. Only layers' rows of targeted slices change value, but a row's scale is
    recomputed only where its slice is targeted, so untouched rows keep their bytes exactly.
    Undoing it is a copy of the saved bytes (serve/lora/modes.py), not a subtraction: rounding
    to FP8 twice would not give the original weights back.
    """
    offsets = [int(o) for o in (slice_offsets.tolist() if torch.is_tensor(slice_offsets) else slice_offsets)]
    rank_table, alpha = ranks.tolist(), float(scales[slot])
    for i, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        r = min(rank_table[i][slot], lora_a.shape[3])
        if r <= 0 or hi == lo:
            continue
        for layer in range(weight.shape[0]):
            rows = dequantize(weight[layer, lo:hi], weight_scale[layer, lo:hi])  # [N_i, K] fp32
            rows.addmm_(lora_b[layer, slot, lo:hi, :r].float(), lora_a[layer, i, slot, :r].float(), alpha=alpha)
            q, s = quantize_weight(rows)
            weight[layer, lo:hi].copy_(q)
            weight_scale[layer, lo:hi].copy_(s)
