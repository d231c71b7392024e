"""ATMM expand: the second half of a batched heterogeneous LoRA, one launch for all adapters.

    for every slice i (output columns off[i]:off[i+1]), segment g (slot s, rank r = ranks[i, s]):
        for every token t of g:
            y[t, off[i]:off[i+1]] += scale[s] * sum_j(v[j, i, t, :r]) @ B[s, off[i]:off[i+1], :r].T

Grid: (segments, token tiles, slices x column groups), or the token tiles of all segments on
one axis (`token_tiles.py`) for long, uneven batches. A column group is `col_tiles` column
tiles that one program covers in a loop with its tokens' v read once (`_expand_columns`);
with one tile per group (the default) the program reduces the rank in BLOCK_K steps instead.
The reduction runs over the adapter's real rank only; each (token, column) of y is read and
written by exactly one program, so no atomics are needed and y is touched once. The shrink's
split-K partial sums (j) are added here.

Mixture batches (`meta.mix_slot` = m) reduce a second stretch in the same program: the
columns of v past the pool's rank against B[m], with m's scale negated, so each token adds
scale[s] * v_own @ B[s].T - scale[m] * v_mix @ B[m].T to y in one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import dot_nt, gdc_wait, interpreted, pdl_launch
from .segments import SegmentMeta, check_slots
from .tiling import TileConfig, next_pow2
from .token_tiles import seg_block, token_grid, token_tile


@triton.jit
def expand_part(v, b_base, offs_n, mask_n, offs_r, rank, scale, stride_bn, stride_br, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """scale * v @ B[:, :rank].T over one column tile, fp32, with v [BLOCK_M, BLOCK_R] held whole
    and zero past the rank (B is read to the next multiple of 16: 16-byte loads)."""
    rank16 = tl.multiple_of((rank + 15) // 16 * 16, 16)  # a bound of known divisibility: 16-byte loads
    b_ptrs = b_base + offs_n[:, None].to(tl.int64) * stride_bn + offs_r[None, :] * stride_br  # rows of B
    b = tl.load(b_ptrs, mask=mask_n[:, None] & (offs_r < rank16)[None, :], other=0.0)
    return dot_nt(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), v, b, UPCAST_DOT) * scale


@triton.jit
def _reduce_rank(v_base, b_base, offs_n, mask_n, mask_m, offs_k, rank, n_splits, stride_vj, stride_vr, stride_bn,
                 stride_br, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST_DOT: tl.constexpr):
    """sum_j(v[j, :, :rank]) @ B[:, :rank].T over one tile of tokens and columns, fp32."""
    # The pool's contract: B's columns past an adapter's rank are zero, and the shrink wrote
    # exact zeros to v there up to the next multiple of 16, so the reduction may run to rank16,
    # a bound whose divisibility keeps the loads vectorized.
    rank16 = tl.multiple_of((rank + 15) // 16 * 16, 16)
    v_ptrs = v_base
    b_ptrs = b_base + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :] * stride_br  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, rank16, BLOCK_K):
        # BLOCK_K divides the pool's max rank, so a whole step of B stays inside the pool and,
        # unmasked along the rank, loads 16 bytes at a time; v past rank16 was never written.
        b = tl.load(b_ptrs, mask=mask_n[:, None], other=0.0)  # rows of B, rank contiguous
        mask_v = mask_m[:, None] & ((k + offs_k) < rank16)[None, :]
        v = tl.load(v_ptrs, mask=mask_v, other=0.0)
        for j in range(1, n_splits):
            v += tl.load(v_ptrs + j * stride_vj, mask=mask_v, other=0.0)
        v = v.to(b.dtype)  # v rounded to the weights' dtype, as PEFT computes it
        acc = dot_nt(acc, v, b, UPCAST_DOT)
        v_ptrs += BLOCK_K * stride_vr
        b_ptrs += BLOCK_K * stride_br
    return acc


@triton.jit
def slice_program_meta(n_col_tiles, seg_len_ptr, seg_start_ptr, seg_slot_ptr, slice_offsets_ptr, ranks_ptr, mix_ptr,
                       stride_ranks_i, n_segments, SLICES_MULT16: tl.constexpr, MIX: tl.constexpr,
                       BLOCK_M: tl.constexpr, SEG_BLOCK: tl.constexpr):
    """What a program of the grid (token axes of `token_tiles`, slices x n_col_tiles) works on:
    (pid_m, pid_n, pid_i, seg_len, seg_start, slot, col_start, col_end, rank, mix, mix_rank), its
    token tile, column tile and slice, then its segment's and slice's metadata. The rank is 0
    where the slot has none of its own (slot -2, mixture); mix / mix_rank are 0 outside a mixture.

    All the loads are issued before the caller's one exit test (see the shrink kernel).
    """
    pid_seg, pid_m = token_tile(seg_len_ptr, n_segments, BLOCK_M, SEG_BLOCK)
    pid_z = tl.program_id(2)
    pid_n = pid_z % n_col_tiles
    pid_i = pid_z // n_col_tiles
    seg_len = tl.load(seg_len_ptr + pid_seg)
    seg_start = tl.load(seg_start_ptr + pid_seg)
    slot = tl.load(seg_slot_ptr + pid_seg)
    col_start = tl.load(slice_offsets_ptr + pid_i)
    col_end = tl.load(slice_offsets_ptr + pid_i + 1)
    if SLICES_MULT16:  # lets Triton prove 16-byte alignment of the y and B rows the caller streams.
        # Here, not in the caller: tl.multiple_of on one result of a call marks every result.
        col_start = tl.multiple_of(col_start, 16)
        col_end = tl.multiple_of(col_end, 16)
    rank = tl.load(ranks_ptr + pid_i * stride_ranks_i + tl.maximum(slot, 0))
    rank = tl.where(slot >= 0, rank, 0)
    mix = 0
    mix_rank = 0
    if MIX:
        mix = tl.load(mix_ptr)
        mix_rank = tl.load(ranks_ptr + pid_i * stride_ranks_i + mix)
    return pid_m, pid_n, pid_i, seg_len, seg_start, slot, col_start, col_end, rank, mix, mix_rank


@triton.jit
def _expand_columns(v_ptr, b_ptr, y_ptr, tokens, mask_m, offs_n, col_end, pid_i, slot, rank, scales_ptr, n_splits,
                    stride_vj, stride_vi, stride_vt, stride_vr, stride_bs, stride_bn, stride_br, stride_yt, stride_yn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, COL_TILES: tl.constexpr,
                    UPCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    """One token tile over COL_TILES column tiles, from `offs_n` on, with the tile's v read once.

    With one column tile per program, every program re-reads its tokens' v (fp32, the rank
    wide, summed over the K splits), so v is read once per column tile of the projection: at
    rank 64 and 8192 tokens that is 2 MB of v read 16-32 times, beside y's 128 MB. Here v is
    summed, rounded to the weights' dtype (as `_reduce_rank` rounds it) and kept in registers,
    and each column tile costs only its B rows and its y tile. The next y tile is loaded before
    the current one's product is stored, so its latency overlaps the store.
    """
    rank16 = tl.multiple_of((rank + 15) // 16 * 16, 16)
    offs_r = tl.arange(0, BLOCK_R)
    mask_y = mask_m[:, None] & (offs_n < col_end)[None, :]
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :] * stride_yn
    y = tl.load(y_ptrs, mask=mask_y, other=0.0)  # the first y tile does not depend on the shrink
    if PDL:
        gdc_wait()
    v_ptrs = v_ptr + pid_i * stride_vi + tokens[:, None] * stride_vt + offs_r[None, :] * stride_vr
    mask_v = mask_m[:, None] & (offs_r < rank16)[None, :]  # v past rank16 was never written
    v = tl.load(v_ptrs, mask=mask_v, other=0.0)
    for j in range(1, n_splits):
        v += tl.load(v_ptrs + j * stride_vj, mask=mask_v, other=0.0)
    v = v.to(b_ptr.dtype.element_ty)
    scale = tl.load(scales_ptr + slot)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    for c in range(COL_TILES):
        mask_n = offs_n < col_end
        acc = expand_part(v, b_base, offs_n, mask_n, offs_r, rank, scale, stride_bn, stride_br, BLOCK_M, BLOCK_N,
                          UPCAST_DOT)
        out = (y.to(tl.float32) + acc).to(y.dtype)
        next_n = offs_n + BLOCK_N
        mask_next = mask_m[:, None] & ((next_n < col_end) & (c + 1 < COL_TILES))[None, :]
        y_next = tl.load(y_ptrs + BLOCK_N * stride_yn, mask=mask_next, other=0.0)
        tl.store(y_ptrs, out, mask=mask_y)
        y, y_ptrs, mask_y, offs_n = y_next, y_ptrs + BLOCK_N * stride_yn, mask_next, next_n


@triton.jit
def _expand_kernel(
    v_ptr, b_ptr, y_ptr,
    token_order_ptr, seg_slot_ptr, seg_start_ptr, seg_len_ptr, ranks_ptr, scales_ptr, slice_offsets_ptr, mix_ptr,
    n_col_groups, n_splits, max_rank, n_segments,
    stride_vj, stride_vi, stride_vt, stride_vr,
    stride_bs, stride_bn, stride_br,
    stride_yt, stride_yn,
    stride_ranks_i,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
    SLICES_MULT16: tl.constexpr, MIX: tl.constexpr, PDL: tl.constexpr, SEG_BLOCK: tl.constexpr,
    COL_TILES: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid_m, pid_n, pid_i, seg_len, seg_start, slot, col_start, col_end, rank, mix, mix_rank = slice_program_meta(
        n_col_groups, seg_len_ptr, seg_start_ptr, seg_slot_ptr, slice_offsets_ptr, ranks_ptr, mix_ptr,
        stride_ranks_i, n_segments, SLICES_MULT16, MIX, BLOCK_M, SEG_BLOCK)
    if (pid_m * BLOCK_M >= seg_len) | (rank + mix_rank == 0) | (col_start + pid_n * (BLOCK_N * COL_TILES) >= col_end):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    tokens = tl.load(token_order_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = col_start + pid_n * (BLOCK_N * COL_TILES) + tl.arange(0, BLOCK_N)
    mask_n = offs_n < col_end
    if COL_TILES > 1:  # v held across a group of column tiles (never a mixture: see `expand`)
        _expand_columns(v_ptr, b_ptr, y_ptr, tokens, mask_m, offs_n, col_end, pid_i, slot, rank, scales_ptr,
                        n_splits, stride_vj, stride_vi, stride_vt, stride_vr, stride_bs, stride_bn, stride_br,
                        stride_yt, stride_yn, BLOCK_M, BLOCK_N, BLOCK_R, COL_TILES, UPCAST_DOT, PDL)
        return
    offs_k = tl.arange(0, BLOCK_K)

    # y is the bulk of the traffic: its load is issued before the reduction so that its
    # latency overlaps the B and v loads instead of following them.
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :] * stride_yn
    mask_y = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask_y, other=0.0)
    if PDL:  # launched behind the shrink, which may still be running: everything above is
        gdc_wait()  # independent of it (see `expand`); v is read only after it has finished
    v_base = v_ptr + pid_i * stride_vi + tokens[:, None] * stride_vt + offs_k[None, :] * stride_vr
    acc = _reduce_rank(v_base, b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs, offs_n, mask_n, mask_m, offs_k,
                       rank, n_splits, stride_vj, stride_vr, stride_bn, stride_br, BLOCK_M, BLOCK_N, BLOCK_K,
                       UPCAST_DOT)
    acc *= tl.load(scales_ptr + tl.maximum(slot, 0))
    if MIX:  # deLoRA's correction: the mixed-in adapter, scale negated, from v's second half
        acc_mix = _reduce_rank(v_base + max_rank * stride_vr, b_ptr + mix.to(tl.int64) * stride_bs, offs_n, mask_n,
                               mask_m, offs_k, mix_rank, n_splits, stride_vj, stride_vr, stride_bn, stride_br,
                               BLOCK_M, BLOCK_N, BLOCK_K, UPCAST_DOT)
        acc -= acc_mix * tl.load(scales_ptr + mix)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask_y)


_OFFSETS: dict[tuple, torch.Tensor] = {}


def slice_offsets(widths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 [slices + 1] cumulative column offsets, cached so graph capture never allocates."""
    key = (tuple(widths), str(device))
    if key not in _OFFSETS:
        offsets = [0]
        for w in widths:
            offsets.append(offsets[-1] + int(w))
        _OFFSETS[key] = torch.tensor(offsets, dtype=torch.int32, device=device)
    return _OFFSETS[key]


def column_groups(widest: int, block_n: int, col_tiles: int) -> tuple[int, int]:
    """(column tiles per group, groups per slice) for slices at most `widest` wide. A group is
    never wider than the widest slice: a nearest-shape table entry may come from a wider
    projection, and tiles past the output would be loops of pure padding."""
    col_tiles = min(col_tiles, next_pow2(triton.cdiv(widest, block_n)))
    return col_tiles, triton.cdiv(widest, block_n * col_tiles)


def check_expand_inputs(y: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor, scales: torch.Tensor,
                        slices: tuple[int, ...]) -> None:
    n_total = sum(slices)
    if y.dtype not in (torch.float16, torch.bfloat16) or y.dim() != 2 or y.shape[1] != n_total:
        raise ValueError(f"y must be fp16/bf16 [tokens, {n_total}], got {y.dtype} {tuple(y.shape)}")
    if lora_b.dim() != 3 or lora_b.shape[1] != n_total or lora_b.dtype != y.dtype:
        raise ValueError(f"lora_b must be {y.dtype} [slots, {n_total}, max_rank], got {lora_b.dtype} "
                         f"{tuple(lora_b.shape)}")
    if tuple(ranks.shape) != (len(slices), lora_b.shape[0]) or ranks.dtype != torch.int32:
        raise ValueError(f"ranks must be int32 [{len(slices)}, {lora_b.shape[0]}], got {ranks.dtype} "
                         f"{tuple(ranks.shape)}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (lora_b.shape[0],):
        raise ValueError(f"scales must be float32 [{lora_b.shape[0]}], got {scales.dtype} {tuple(scales.shape)}")
    if lora_b.shape[2] % 16:
        raise ValueError(f"lora_b's max_rank ({lora_b.shape[2]}) must be a multiple of 16: pad the pool")
    if y.stride(-1) != 1 or lora_b.stride(-1) != 1:
        raise ValueError("y and lora_b need a contiguous last dimension")


def expand(y: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, meta: SegmentMeta, ranks: torch.Tensor,
           scales: torch.Tensor, slices: tuple[int, ...], config: TileConfig, pdl: bool = False,
           flat: bool | None = None) -> torch.Tensor:
    """y[:, slice i] += scale * v[i] @ B[slot, slice i].T per segment, in place; returns y.

    y: [T, sum(slices)] fp16/bf16; v: float32 [splits, slices, T, R] from `shrink` ([..., 2R] for a
    mixture batch, whose `meta.mix_slot` is then subtracted too);
    lora_b: [slots, sum(slices), R] (PEFT's lora_B layout, slices stacked); ranks: int32
    [slices, slots]; scales: float32 [slots]; slices: output width of each slice (host ints).
    flat: the token tiles' layout on the grid (`token_tiles.seg_block`; None: the one that
    launches fewer programs).
    """
    check_expand_inputs(y, lora_b, ranks, scales, slices)
    check_slots(meta, lora_b.shape[0])
    mix = meta.mix_slot is not None
    v_cols = lora_b.shape[2] * (2 if mix else 1)
    if v.dtype != torch.float32 or v.dim() != 4 or tuple(v.shape[1:]) != (len(slices), y.shape[0], v_cols):
        raise ValueError(f"v must be float32 [splits, {len(slices)}, {y.shape[0]}, {v_cols}], "
                         f"got {v.dtype} {tuple(v.shape)}")
    if meta.num_segments == 0 or meta.max_seg_len == 0:
        return y
    # A mixture keeps one column tile per program: its second v stretch would double the v
    # held in registers, and the tilings are searched on plain batches.
    col_tiles, n_col_groups = column_groups(max(slices), config.block_n, 1 if mix else config.col_tiles)
    block_k = config.block_k
    while lora_b.shape[2] % block_k:  # the reduction step must divide the pool's rank (see kernel)
        block_k //= 2
    block = seg_block(meta, config.block_m, flat)
    grid = (*token_grid(meta, config.block_m, block), len(slices) * n_col_groups)
    _expand_kernel[grid](
        v, lora_b, y, meta.token_order, meta.seg_slot, meta.seg_start, meta.seg_len, ranks, scales,
        slice_offsets(slices, y.device), meta.mix_slot if mix else meta.seg_slot,  # unread without MIX
        n_col_groups, v.shape[0], lora_b.shape[2], meta.num_segments,
        v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        ranks.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, UPCAST_DOT=interpreted(),
        SLICES_MULT16=all(w % 16 == 0 for w in slices), MIX=mix, PDL=pdl, SEG_BLOCK=block,
        COL_TILES=col_tiles, BLOCK_R=max(16, next_pow2(lora_b.shape[2])),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(pdl),
    )
    return y
