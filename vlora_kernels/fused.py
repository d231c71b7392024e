"""ATMM in one launch for decode-sized batches: shrink and expand fused, v never leaves the SM.

    for every segment g (slot s), token tile, slice i, group of `col_tiles` column tiles:
        v = x[tile] @ A[i, s, :r].T                           (whole K, fp32, in registers)
        for each column tile c of the group:
            y[tile, c] += scale[s] * v @ B[s, c, :r].T

At decode the two-launch op (`lora.py`) is dominated by its launches, not its bytes; here one
launch does it all. The price is redundancy: every program recomputes v for its own columns,
so a slice cut into P column groups reads A[i, s] and does the shrink's arithmetic P times
(each program streams A alone, at one SM's bandwidth). `col_tiles` sets P; `tiling.py`
explains how the heuristic tiling bounds it, and records that the trade-off lost on an H100
at every decode shape timed, so `add_lora` sends a batch here only where the device's table
measured this kernel faster than the two launches.

Rows of A and columns of B past an adapter's rank never contribute: A's rows are masked at
the exact rank, so v is exactly zero past it, and the B tiles (read to the next multiple of 16,
which keeps the loads vectorized) only ever meet those zeros: any finite values the pool holds
there add exact zeros. (The two launches rely on the pool's contract instead: zeros there.)

Mixture batches (`meta.mix_slot` = m) take the same shape as in the two-launch op: each
program also computes v_mix = x @ A[m].T in the same K loop (one x read for both) and
subtracts scale[m] * v_mix @ B[m].T, in the same rounding into y. Slot -2 segments have no
part of their own. `add_lora` never sends a mixture here (see `lora.one_launch_for`); its
tilings are searched on plain batches, and a mixture's second A tile per K step may not fit
the shared memory of a tiling chosen near the limit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .expand import check_expand_inputs, expand_part, slice_offsets, slice_program_meta
from .interpreter import dot_nt, interpreted
from .segments import SegmentMeta, check_slots
from .shrink import check_lora_inputs, k_step
from .tiling import FUSED_MAX_RANK, TileConfig, next_pow2


@triton.jit
def _fused_kernel(
    x_ptr, a_ptr, b_ptr, y_ptr,
    token_order_ptr, seg_slot_ptr, seg_start_ptr, seg_len_ptr, ranks_ptr, scales_ptr, slice_offsets_ptr, mix_ptr,
    K, n_col_groups, n_segments,
    stride_xt, stride_xk,
    stride_ai, stride_as, stride_ar, stride_ak,
    stride_bs, stride_bn, stride_br,
    stride_yt, stride_yn,
    stride_ranks_i,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    COL_TILES: tl.constexpr, UPCAST_DOT: tl.constexpr, EVEN_K: tl.constexpr, SLICES_MULT16: tl.constexpr,
    MIX: tl.constexpr,
):
    pid_m, pid_c, pid_i, seg_len, seg_start, slot, col_start, col_end, rank, mix, mix_rank = slice_program_meta(
        n_col_groups, seg_len_ptr, seg_start_ptr, seg_slot_ptr, slice_offsets_ptr, ranks_ptr, mix_ptr, stride_ranks_i,
        n_segments, SLICES_MULT16, MIX, BLOCK_M, 0)  # decode only: the by-segment grid (token_tiles.py)
    first_col = col_start + pid_c * (COL_TILES * BLOCK_N)  # a multiple of 16 when col_start is (SLICES_MULT16)
    if (pid_m * BLOCK_M >= seg_len) | (rank + mix_rank == 0) | (first_col >= col_end):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    tokens = tl.load(token_order_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    own = tl.maximum(slot, 0).to(tl.int64)  # slot -2 (mixture): rank 0 masks every load of it

    # The shrink over the whole K (K, an argument, carries its divisibility by 16 into the
    # compiled kernel by itself: no K_MULT16 hint as in the split-K shrink). Rows of A are
    # masked at the exact rank, so v is zero past it.
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    a_rows = offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ak  # [BLOCK_R, BLOCK_K]
    a_ptrs = a_ptr + pid_i.to(tl.int64) * stride_ai + own * stride_as + a_rows
    mask_a = offs_r < rank
    v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if MIX:
        am_ptrs = a_ptr + pid_i.to(tl.int64) * stride_ai + mix.to(tl.int64) * stride_as + a_rows
        mask_am = offs_r < mix_rank
        v_mix = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = k_step(x_ptrs, mask_m, k + offs_k, K, EVEN_K)
        v = dot_nt(v, x, k_step(a_ptrs, mask_a, k + offs_k, K, EVEN_K), UPCAST_DOT)
        if MIX:
            v_mix = dot_nt(v_mix, x, k_step(am_ptrs, mask_am, k + offs_k, K, EVEN_K), UPCAST_DOT)
            am_ptrs += BLOCK_K * stride_ak
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak

    # The expand over this program's column tiles, v held in registers. v is rounded to the
    # weights' dtype before the product, as PEFT (and the two-launch expand) compute it.
    v = v.to(b_ptr.dtype.element_ty)
    scale = tl.load(scales_ptr + own)
    if MIX:
        v_mix = v_mix.to(b_ptr.dtype.element_ty)
        mix_scale = -tl.load(scales_ptr + mix)  # deLoRA's correction: the mixed-in adapter, negated
    n_tiles = tl.minimum(COL_TILES, tl.cdiv(col_end - first_col, BLOCK_N))  # the slice's last group may be short
    for c in range(0, n_tiles):
        offs_n = first_col + c * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < col_end
        y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :] * stride_yn
        mask_y = mask_m[:, None] & mask_n[None, :]
        y = tl.load(y_ptrs, mask=mask_y, other=0.0)  # issued first: its latency overlaps B's
        acc = expand_part(v, b_ptr + own * stride_bs, offs_n, mask_n, offs_r, rank, scale, stride_bn, stride_br,
                           BLOCK_M, BLOCK_N, UPCAST_DOT)
        if MIX:
            acc += expand_part(v_mix, b_ptr + mix.to(tl.int64) * stride_bs, offs_n, mask_n, offs_r, mix_rank,
                                mix_scale, stride_bn, stride_br, BLOCK_M, BLOCK_N, UPCAST_DOT)
        tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask_y)


def check_one_launch_inputs(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                            meta: SegmentMeta, ranks: torch.Tensor, scales: torch.Tensor, slices) -> tuple[int, ...]:
    """The checks of a one-launch ATMM kernel (this one, `handoff.py`), before any work: the two
    launches' input checks, their agreement, and a pool rank a program can hold whole in
    registers. Returns the slices as a tuple of ints."""
    slices = tuple(int(w) for w in slices)
    if len(slices) != lora_a.shape[0]:
        raise ValueError(f"slices {slices} name {len(slices)} output slices but lora_a has {lora_a.shape[0]}")
    check_lora_inputs(x, lora_a, ranks)
    check_expand_inputs(y, lora_b, ranks, scales, slices)
    check_slots(meta, lora_b.shape[0])
    if y.shape[0] != x.shape[0] or meta.num_tokens != x.shape[0]:
        raise ValueError(f"x has {x.shape[0]} tokens, y {y.shape[0]}, the segment metadata {meta.num_tokens}: "
                         "they must agree")
    if lora_b.shape[2] != lora_a.shape[2]:
        raise ValueError(f"lora_a's max_rank ({lora_a.shape[2]}) differs from lora_b's ({lora_b.shape[2]})")
    if lora_a.shape[2] > FUSED_MAX_RANK:
        raise ValueError(f"a one-launch kernel holds the whole rank in registers: the pool's max_rank "
                         f"({lora_a.shape[2]}) must be <= {FUSED_MAX_RANK}; use add_lora's two launches")
    for name, t in (("y", y), ("lora_b", lora_b), ("scales", scales)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    return slices


def fused_add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, meta: SegmentMeta,
                   ranks: torch.Tensor, scales: torch.Tensor, slices, config: TileConfig) -> torch.Tensor:
    """`add_lora` in one launch (same arguments and result, y updated in place and returned),
    for pools of max rank <= 128; `config` as `heuristic_config` / the table give it for op "fused"."""
    slices = check_one_launch_inputs(y, x, lora_a, lora_b, meta, ranks, scales, slices)
    if config.split_k != 1:
        raise ValueError(f"the fused kernel reduces the whole K in each program: split_k must be 1, got {config}")
    if meta.num_segments == 0 or meta.max_seg_len == 0:
        return y
    mix = meta.mix_slot is not None
    k = x.shape[1]
    n_col_groups = triton.cdiv(max(slices), config.block_n * config.col_tiles)
    grid = (meta.num_segments, triton.cdiv(meta.max_seg_len, config.block_m), len(slices) * n_col_groups)
    _fused_kernel[grid](
        x, lora_a, lora_b, y, meta.token_order, meta.seg_slot, meta.seg_start, meta.seg_len, ranks, scales,
        slice_offsets(slices, y.device), meta.mix_slot if mix else meta.seg_slot,  # unread without MIX
        k, n_col_groups, meta.num_segments,
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), lora_a.stride(3),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        ranks.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        BLOCK_R=max(16, next_pow2(lora_a.shape[2])), COL_TILES=config.col_tiles, UPCAST_DOT=interpreted(),
        EVEN_K=k % config.block_k == 0, SLICES_MULT16=all(w % 16 == 0 for w in slices), MIX=mix,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y
