"""One-launch-per-slice merge of a LoRA slot into FP8 weights, requantized per output channel, in place.

    for l in range(L), slice i targeted by `slot` (rank r > 0), rows n in [lo, hi):
        v = weight[l, n, :] * weight_scale[l, n] + scales[slot] * lora_b[l, slot, n, :r] @ lora_a[l, i, slot, :r]
        weight_scale[l, n] = max(amax(|v|) / 448, SCALE_FLOOR)
        weight[l, n, :] = fp8(clamp(v / weight_scale[l, n], +-448))

A program owns BLOCK_N whole rows of one layer (a row's scale needs its whole row): the first sweep
over K forms v tile by tile for the rows' amax, the second forms v again (the FP8 tile and A come
from L2 the second time) and writes it quantized. Each weight byte is read twice and written once;
a bf16 merge reads and writes two bytes. `vlora_kernels.fp8.merge_fp8_ref_` is the PyTorch reference
(per layer, fp32), the CPU path; results agree up to the fp32 summation order (a code step of FP8
where a value sits on a rounding boundary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import FP8_DTYPE, FP8_MAX, SCALE_FLOOR
from .interpreter import interpreted


@triton.jit
def _merged_tile(w_rows, old_scale, a_base, b, alpha, offs_k, offs_r, mask_n, mask_r, K,
                 stride_wk, stride_ar, stride_ak, UPCAST_DOT: tl.constexpr):
    # -> [BLOCK_N, BLOCK_K] fp32: dequantized weight tile + alpha * B[rows, :r] @ A[:r, offs_k]
    mask_k = offs_k < K
    w = tl.load(w_rows + offs_k[None, :] * stride_wk, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
    a = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                mask=mask_r[:, None] & mask_k[None, :], other=0.0)
    if UPCAST_DOT:  # see vlora_kernels.interpreter
        a = a.to(tl.float32)
    delta = tl.dot(b, a, input_precision="ieee")
    return w.to(tl.float32) * old_scale[:, None] + alpha * delta


@triton.jit
def _merge_fp8_kernel(w_ptr, q_ptr, s_ptr, a_ptr, b_ptr, scales_ptr, slot, row_start, row_end, K, rank,
                      stride_wl, stride_wn, stride_wk, stride_ql, stride_qn, stride_qk, stride_sl,
                      stride_al, stride_ar, stride_ak, stride_bl, stride_bn, stride_br,
                      FP8_LIMIT: tl.constexpr, FLOOR: tl.constexpr, R_PAD: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr):
    # grid: (cdiv(row_end - row_start, BLOCK_N), L)
    pid_n = tl.program_id(0)
    pid_l = tl.program_id(1).to(tl.int64)  # L * N * K passes 2**31 at the 7B's gate_up
    offs_n = row_start + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < row_end
    offs_r = tl.arange(0, R_PAD)
    mask_r = offs_r < rank
    offs_k0 = tl.arange(0, BLOCK_K)
    alpha = tl.load(scales_ptr + slot)
    b = tl.load(b_ptr + pid_l * stride_bl + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_N, R_PAD]
    if UPCAST_DOT:
        b = b.to(tl.float32)
    s_rows = s_ptr + pid_l * stride_sl + offs_n
    old_scale = tl.load(s_rows, mask=mask_n, other=0.0)
    w_rows = w_ptr + pid_l * stride_wl + offs_n[:, None] * stride_wn
    a_base = a_ptr + pid_l * stride_al
    amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        v = _merged_tile(w_rows, old_scale, a_base, b, alpha, k0 + offs_k0, offs_r, mask_n, mask_r, K,
                         stride_wk, stride_ar, stride_ak, UPCAST_DOT)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
    new_scale = tl.maximum(tl.math.div_rn(amax, FP8_LIMIT), FLOOR)  # IEEE division, as torch's
    q_rows = q_ptr + pid_l * stride_ql + (offs_n - row_start)[:, None] * stride_qn
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_k0
        v = _merged_tile(w_rows, old_scale, a_base, b, alpha, offs_k, offs_r, mask_n, mask_r, K,
                         stride_wk, stride_ar, stride_ak, UPCAST_DOT)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, new_scale[:, None]), -FP8_LIMIT), FP8_LIMIT)
        tl.store(q_rows + offs_k[None, :] * stride_qk, q.to(q_ptr.dtype.element_ty),
                 mask=mask_n[:, None] & (offs_k < K)[None, :])
    tl.store(s_rows, new_scale, mask=mask_n)


def merge_fp8_(weight: torch.Tensor, weight_scale: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               slot: int, ranks: torch.Tensor, scales: torch.Tensor, slice_offsets, block_n: int = 32,
               block_k: int = 128, num_warps: int = 4) -> None:
    """`vlora_kernels.fp8.merge_fp8_ref_` in one Triton launch per targeted slice.

    weight: [L, N_total, K] fp8 contiguous; weight_scale: [L, N_total] fp32; lora_a: [L, n_slices, S, R_max, K];
    lora_b: [L, S, N_total, R_max]; ranks: int32 [n_slices, S]; scales: fp32 [S]; slice_offsets: list
    or tensor of n_slices + 1 row offsets. Ranks and offsets are read on the host (a switch syncs anyway).
    """
    if weight.dtype != FP8_DTYPE or weight.dim() != 3 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [L, N_total, K] {FP8_DTYPE}, got {weight.dtype} "
                         f"of shape {tuple(weight.shape)}")
    if tuple(weight_scale.shape) != tuple(weight.shape[:2]) or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be fp32 [L, N_total] = {tuple(weight.shape[:2])}, "
                         f"got {weight_scale.dtype} of shape {tuple(weight_scale.shape)}")
    n_layers, _, k = weight.shape
    offsets = [int(o) for o in (slice_offsets.tolist() if torch.is_tensor(slice_offsets) else slice_offsets)]
    rank_table = ranks.tolist()
    # The interpreter rounds float32 -> e4m3 wrongly (vlora_kernels/fp8.py): there the kernel writes float32
    # rows and torch casts them with round-to-nearest-even, as the GPU does
    cast_here = interpreted()
    for i, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        r = min(rank_table[i][slot], lora_a.shape[3])
        if r <= 0 or hi == lo:
            continue
        a = lora_a[:, i, slot]  # [L, R_max, K]
        b = lora_b[:, slot]  # [L, N_total, R_max]
        # rows lo..hi-1 of the result; in place on the GPU (each program reads a tile before it writes it)
        out = torch.empty((n_layers, hi - lo, k), dtype=torch.float32, device=weight.device) if cast_here \
            else weight[:, lo:hi]
        grid = (triton.cdiv(hi - lo, block_n), n_layers)
        _merge_fp8_kernel[grid](
            weight, out, weight_scale, a, b, scales, slot, lo, hi, k, r,
            *weight.stride(), *out.stride(), weight_scale.stride(0), *a.stride(), *b.stride(),
            FP8_LIMIT=FP8_MAX, FLOOR=SCALE_FLOOR, R_PAD=max(16, triton.next_power_of_2(r)),
            BLOCK_N=block_n, BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k))), UPCAST_DOT=cast_here,
            num_warps=num_warps)
        if cast_here:
            weight[:, lo:hi].copy_(out.to(FP8_DTYPE))
