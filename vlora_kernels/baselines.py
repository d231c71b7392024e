"""The two custom-kernel baselines the V-LoRA paper measures ATMM against, rewritten in Triton from
the papers' descriptions, behind the call signature of `reference.py`:

    lora_sgmv(y, x, lora_a, lora_b, meta, ranks, scales, slices)    # Punica's SGMV
    lora_mbgmv(y, x, lora_a, lora_b, meta, ranks, scales, slices)   # S-LoRA's MBGMV

SGMV (segmented gather matrix-vector, Punica): tokens grouped in contiguous segments per adapter,
one program per (segment, token tile, ...) multiplying the tile by that adapter's weights on the
tensor cores. Every adapter is computed at the pool's padded rank R, Punica's one rank per launch.
The shrink splits K across programs (split-K) and adds the partial sums into a zeroed v with
atomics, in place of Punica's grid-wide barrier and cross-block reduction; the expand splits the
output columns across programs. Tiles are fixed constants, whatever the shape.

MBGMV (multi-size batched gather matrix-vector, S-LoRA): one program per token (and slice, and rank
chunk or column tile): the token gathers its own adapter and runs matrix-vector products on the
CUDA cores (no tl.dot, no tile of tokens, so an adapter is read once per token), over the
adapter's own rank only: rows of A and columns of B past it are never read, rank chunks past it
launch programs that exit at once.

How both differ from ATMM (`shrink.py`, `expand.py`): ATMM picks its tiles per shape from a
searched table, tiles over the real rank of each adapter and adds the split-K planes up inside
the expand (no zeroing, no atomics). Neither Punica nor S-LoRA has a mixture (deLoRA) mode, so a
mixture batch raises NotImplementedError here.

x, y and the pool may be float16, bfloat16 or float32 (float32 products without TF32); every sum
is kept in float32 and y is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .expand import slice_offsets
from .interpreter import dot_nt, interpreted
from .segments import SegmentMeta

SGMV_SHRINK = dict(BLOCK_M=16, BLOCK_K=64)
SGMV_EXPAND = dict(BLOCK_M=16, BLOCK_N=64)
SGMV_K_PER_SPLIT = 512  # input features per split-K program
MBGMV_SHRINK = dict(BLOCK_R=16, BLOCK_K=128)
MBGMV_EXPAND = dict(BLOCK_N=128, BLOCK_R=16)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _dot(acc, a, b, IEEE: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc + a @ b.T; float32 operands are multiplied in full precision (TF32 would cost ~1e-3)."""
    if IEEE:
        return acc + tl.dot(a, tl.trans(b), input_precision="ieee")
    return dot_nt(acc, a, b, UPCAST_DOT)


@triton.jit
def _program(n_per_slice, seg_slot_ptr, seg_start_ptr, seg_len_ptr, ranks_ptr, stride_ranks_i):
    """(segment length, start, slot, the slot's rank in this slice, slice, program within the slice)
    of a program on the grid both ops share: (place in the segment, segment, slice x n_per_slice).
    The place in the segment is on axis 0, the one axis CUDA lets grow past 65535 (MBGMV: a token each)."""
    pid_seg = tl.program_id(1)
    pid_i = tl.program_id(2) // n_per_slice
    seg_len = tl.load(seg_len_ptr + pid_seg)
    seg_start = tl.load(seg_start_ptr + pid_seg)
    slot = tl.load(seg_slot_ptr + pid_seg)
    rank = tl.load(ranks_ptr + pid_i * stride_ranks_i + slot)
    return seg_len, seg_start, slot, rank, pid_i, tl.program_id(2) % n_per_slice


@triton.jit
def _tile_tokens(token_order_ptr, seg_start, seg_len, BLOCK_M: tl.constexpr):
    """(token indices, mask) of this program's tile of its segment."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    return tl.load(token_order_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64), mask_m


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, v_ptr, token_order_ptr, seg_slot_ptr, seg_start_ptr, seg_len_ptr, ranks_ptr,
    K, k_per_split, max_rank,
    stride_xt, stride_ai, stride_as, stride_ar, stride_vi, stride_vt, stride_ranks_i,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    IEEE: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    seg_len, seg_start, slot, rank, pid_i, pid_k = _program(SPLIT_K, seg_slot_ptr, seg_start_ptr, seg_len_ptr,
                                                            ranks_ptr, stride_ranks_i)
    # The rank is read only to skip slices the adapter does not target; the work is at the padded rank.
    if (tl.program_id(0) * BLOCK_M >= seg_len) | (rank == 0):
        return
    tokens, mask_m = _tile_tokens(token_order_ptr, seg_start, seg_len, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < max_rank
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    a_base = a_ptr + pid_i.to(tl.int64) * stride_ai + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        mask_k = (k + offs_k) < k_end
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + (k + offs_k)[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_base + offs_r[:, None] * stride_ar + (k + offs_k)[None, :],
                    mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        acc = _dot(acc, x, a, IEEE, UPCAST_DOT)
    v_ptrs = v_ptr + pid_i * stride_vi + tokens[:, None] * stride_vt + offs_r[None, :]
    mask_v = mask_m[:, None] & mask_r[None, :]
    if SPLIT_K == 1:
        tl.store(v_ptrs, acc, mask=mask_v)
    else:
        tl.atomic_add(v_ptrs, acc, mask=mask_v)


@triton.jit
def _sgmv_expand_kernel(
    v_ptr, b_ptr, y_ptr, token_order_ptr, seg_slot_ptr, seg_start_ptr, seg_len_ptr, ranks_ptr, scales_ptr,
    slice_offsets_ptr, n_col_tiles, max_rank,
    stride_vi, stride_vt, stride_bs, stride_bn, stride_yt, stride_ranks_i,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    seg_len, seg_start, slot, rank, pid_i, pid_n = _program(n_col_tiles, seg_slot_ptr, seg_start_ptr, seg_len_ptr,
                                                            ranks_ptr, stride_ranks_i)
    col_start = tl.load(slice_offsets_ptr + pid_i)
    col_end = tl.load(slice_offsets_ptr + pid_i + 1)
    if (tl.program_id(0) * BLOCK_M >= seg_len) | (rank == 0) | (col_start + pid_n * BLOCK_N >= col_end):
        return
    tokens, mask_m = _tile_tokens(token_order_ptr, seg_start, seg_len, BLOCK_M)
    offs_n = col_start + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < col_end
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < max_rank
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None].to(tl.int64) * stride_bn + offs_r[None, :],
                mask=mask_n[:, None] & mask_r[None, :], other=0.0)
    v = tl.load(v_ptr + pid_i * stride_vi + tokens[:, None] * stride_vt + offs_r[None, :],
                mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    # v goes to the tensor cores in the weights' dtype, as Punica keeps it in 16 bits
    acc = _dot(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), v.to(b.dtype), b, IEEE, UPCAST_DOT)
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :]
    mask_y = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask_y, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc * tl.load(scales_ptr + slot)).to(y.dtype), mask=mask_y)


@triton.jit
def _mbgmv_shrink_kernel(
    x_ptr, a_ptr, v_ptr, token_order_ptr, seg_slot_ptr, seg_start_ptr, seg_len_ptr, ranks_ptr,
    K, n_rank_chunks,
    stride_xt, stride_ai, stride_as, stride_ar, stride_vi, stride_vt, stride_ranks_i,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    seg_len, seg_start, slot, rank, pid_i, pid_c = _program(n_rank_chunks, seg_slot_ptr, seg_start_ptr, seg_len_ptr,
                                                            ranks_ptr, stride_ranks_i)
    pid_t = tl.program_id(0)
    if (pid_t >= seg_len) | (pid_c * BLOCK_R >= rank):
        return
    token = tl.load(token_order_ptr + seg_start + pid_t).to(tl.int64)
    offs_r = pid_c * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + pid_i.to(tl.int64) * stride_ai + slot.to(tl.int64) * stride_as + offs_r[:, None] * stride_ar
    # Elementwise products summed once after the loop: one cross-lane reduction instead of one per step.
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        mask_k = (k + offs_k) < K
        x = tl.load(x_ptr + token * stride_xt + k + offs_k, mask=mask_k, other=0.0)
        a = tl.load(a_base + (k + offs_k)[None, :], mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(v_ptr + pid_i * stride_vi + token * stride_vt + offs_r, tl.sum(acc, axis=1), mask=mask_r)


@triton.jit
def _mbgmv_expand_kernel(
    v_ptr, b_ptr, y_ptr, token_order_ptr, seg_slot_ptr, seg_start_ptr, seg_len_ptr, ranks_ptr, scales_ptr,
    slice_offsets_ptr, n_col_tiles,
    stride_vi, stride_vt, stride_bs, stride_bn, stride_yt, stride_ranks_i,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    seg_len, seg_start, slot, rank, pid_i, pid_n = _program(n_col_tiles, seg_slot_ptr, seg_start_ptr, seg_len_ptr,
                                                            ranks_ptr, stride_ranks_i)
    pid_t = tl.program_id(0)
    col_start = tl.load(slice_offsets_ptr + pid_i)
    col_end = tl.load(slice_offsets_ptr + pid_i + 1)
    if (pid_t >= seg_len) | (rank == 0) | (col_start + pid_n * BLOCK_N >= col_end):
        return
    token = tl.load(token_order_ptr + seg_start + pid_t).to(tl.int64)
    offs_n = col_start + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < col_end
    offs_r = tl.arange(0, BLOCK_R)
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None].to(tl.int64) * stride_bn
    v_base = v_ptr + pid_i * stride_vi + token * stride_vt
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):  # the adapter's own rank: nothing past it is read
        mask_r = (r + offs_r) < rank
        v = tl.load(v_base + r + offs_r, mask=mask_r, other=0.0)
        b = tl.load(b_base + (r + offs_r)[None, :], mask=mask_n[:, None] & mask_r[None, :], other=0.0)
        acc += b.to(tl.float32) * v[None, :]
    y_ptrs = y_ptr + token * stride_yt + offs_n
    y = tl.load(y_ptrs, mask=mask_n, other=0.0)
    out = y.to(tl.float32) + tl.sum(acc, axis=1) * tl.load(scales_ptr + slot)
    tl.store(y_ptrs, out.to(y.dtype), mask=mask_n)


def _checked(y, x, lora_a, lora_b, meta: SegmentMeta, ranks, scales, slices) -> tuple[int, ...]:
    """slices as host ints, once the inputs are known to fit the pool layout of `__init__.py`."""
    if meta.host_mix_slot >= 0:
        raise NotImplementedError("SGMV and MBGMV have no mixture (deLoRA) mode: use add_lora or lora_reference")
    slices = tuple(int(w) for w in slices)
    if x.dtype not in _DTYPES or any(t.dtype != x.dtype for t in (y, lora_a, lora_b)):
        raise TypeError(f"x, y, lora_a and lora_b must share one dtype of {_DTYPES}, got "
                        f"{x.dtype}, {y.dtype}, {lora_a.dtype}, {lora_b.dtype}")
    n_slices, n_slots, max_rank, k = lora_a.shape
    expected = dict(x=(y.shape[0], k), y=(x.shape[0], sum(slices)), lora_b=(n_slots, sum(slices), max_rank),
                    ranks=(n_slices, n_slots), scales=(n_slots,))
    got = dict(x=x, y=y, lora_b=lora_b, ranks=ranks, scales=scales)
    wrong = [f"{name} {tuple(got[name].shape)} (expected {shape})" for name, shape in expected.items()
             if tuple(got[name].shape) != shape]
    if wrong or len(slices) != n_slices:
        raise ValueError(f"shapes do not fit lora_a {tuple(lora_a.shape)} and slices {slices}: {', '.join(wrong)}")
    if ranks.dtype != torch.int32 or scales.dtype != torch.float32:
        raise TypeError(f"ranks must be int32 and scales float32, got {ranks.dtype} and {scales.dtype}")
    if any(t.device != x.device for t in (y, lora_a, lora_b, ranks, scales, meta.token_order)):
        raise ValueError(f"every input must be on x's device ({x.device})")
    if any(t.stride(-1) != 1 for t in (x, y, lora_a, lora_b)):
        raise ValueError("x, y, lora_a and lora_b need a contiguous last dimension")
    return slices


def _segments(meta: SegmentMeta) -> tuple:
    return meta.token_order, meta.seg_slot, meta.seg_start, meta.seg_len


def lora_sgmv(y, x, lora_a, lora_b, meta: SegmentMeta, ranks, scales, slices, k_per_split: int = SGMV_K_PER_SPLIT):
    """Punica's SGMV: y += LoRA(x) in place, every adapter at the pool's padded rank; returns y.

    k_per_split: input features per split-K program (rounded up to a multiple of 16, which keeps
    every split's loads aligned).
    """
    slices = _checked(y, x, lora_a, lora_b, meta, ranks, scales, slices)
    if meta.num_segments == 0 or meta.max_seg_len == 0:
        return y
    n_slices, _, max_rank, k = lora_a.shape
    block_r = max(16, triton.next_power_of_2(max_rank))
    k_per_split = triton.cdiv(max(1, k_per_split), 16) * 16
    split_k = triton.cdiv(k, k_per_split)
    # Split-K programs add into v, so it starts at zero (Punica's v := 0); one split stores directly.
    v = (torch.zeros if split_k > 1 else torch.empty)((n_slices, x.shape[0], max_rank), dtype=torch.float32,
                                                      device=x.device)
    ieee, upcast = x.dtype == torch.float32, interpreted()
    n_tiles = triton.cdiv(meta.max_seg_len, SGMV_SHRINK["BLOCK_M"])
    _sgmv_shrink_kernel[(n_tiles, meta.num_segments, n_slices * split_k)](
        x, lora_a, v, *_segments(meta), ranks, k, k_per_split, max_rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), v.stride(0), v.stride(1), ranks.stride(0),
        BLOCK_R=block_r, SPLIT_K=split_k, IEEE=ieee, UPCAST_DOT=upcast, **SGMV_SHRINK,
    )
    n_col_tiles = triton.cdiv(max(slices), SGMV_EXPAND["BLOCK_N"])
    n_tiles = triton.cdiv(meta.max_seg_len, SGMV_EXPAND["BLOCK_M"])
    _sgmv_expand_kernel[(n_tiles, meta.num_segments, n_slices * n_col_tiles)](
        v, lora_b, y, *_segments(meta), ranks, scales, slice_offsets(slices, y.device), n_col_tiles, max_rank,
        v.stride(0), v.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0), ranks.stride(0),
        BLOCK_R=block_r, IEEE=ieee, UPCAST_DOT=upcast, **SGMV_EXPAND,
    )
    return y


def lora_mbgmv(y, x, lora_a, lora_b, meta: SegmentMeta, ranks, scales, slices):
    """S-LoRA's MBGMV: y += LoRA(x) in place, token by token, each at its adapter's own rank; returns y."""
    slices = _checked(y, x, lora_a, lora_b, meta, ranks, scales, slices)
    if meta.num_segments == 0 or meta.max_seg_len == 0:
        return y
    n_slices, _, max_rank, k = lora_a.shape
    # Only the first ranks[i, slot] columns of a token's row of v are written, and only those are read.
    v = torch.empty((n_slices, x.shape[0], max_rank), dtype=torch.float32, device=x.device)
    n_rank_chunks = triton.cdiv(max_rank, MBGMV_SHRINK["BLOCK_R"])
    _mbgmv_shrink_kernel[(meta.max_seg_len, meta.num_segments, n_slices * n_rank_chunks)](
        x, lora_a, v, *_segments(meta), ranks, k, n_rank_chunks,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), v.stride(0), v.stride(1), ranks.stride(0),
        **MBGMV_SHRINK,
    )
    n_col_tiles = triton.cdiv(max(slices), MBGMV_EXPAND["BLOCK_N"])
    _mbgmv_expand_kernel[(meta.max_seg_len, meta.num_segments, n_slices * n_col_tiles)](
        v, lora_b, y, *_segments(meta), ranks, scales, slice_offsets(slices, y.device), n_col_tiles,
        v.stride(0), v.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0), ranks.stride(0),
        **MBGMV_EXPAND,
    )
    return y
