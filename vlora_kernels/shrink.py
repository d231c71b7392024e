"""ATMM shrink: the first half of a batched heterogeneous LoRA, one launch for all adapters.

    for every slice i, segment g (slot s = seg_slot[g], rank r = ranks[i, s]):
        for every token t of g, every K split j:
            v[j, i, t, :r] = x[t, kj] @ A[i, s, :r, kj].T      (fp32 accumulation)

Grid: (segments, token tiles, slices x rank tiles x K splits), or the token tiles of all
segments on one axis (`token_tiles.py`) for long, uneven batches. Programs past a segment's
length or a slice's rank exit at once, so padding segments, untargeted slices and unused
rank columns cost nothing. Split-K partial sums go to their own plane of v and the expand
adds them up as it reads v: no zeroed buffer, no atomics, and the same bits on every run.

Mixture batches (`meta.mix_slot`, serve/lora/modes.py) double the rank axis: v[..., R:2R] holds
x @ A[mix].T for every token of every segment, computed by programs of their own in the same
launch, so deLoRA's correction costs no second pass. Segments of slot -2 (no adapter of their
own) compute only that half.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .interpreter import dot_nt, gdc_launch_dependents, interpreted
from .segments import SegmentMeta, check_slots
from .tiling import TileConfig
from .token_tiles import seg_block, token_grid, token_tile


@triton.jit
def k_step(ptrs, mask_rows, offs_k, k_end, EVEN_K: tl.constexpr):
    """One [rows, BLOCK_K] tile of a K-contiguous operand (x, A); rows past the mask and columns
    past k_end read as zeros."""
    if EVEN_K:  # every step is a whole tile: row masks only, which keep the loads 16 bytes wide
        return tl.load(ptrs, mask=mask_rows[:, None], other=0.0)
    return tl.load(ptrs, mask=mask_rows[:, None] & (offs_k < k_end)[None, :], other=0.0)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, v_ptr,
    token_order_ptr, seg_slot_ptr, seg_start_ptr, seg_len_ptr, ranks_ptr, mix_ptr,
    K, k_per_split, n_rank_tiles, max_rank, n_segments,
    stride_xt, stride_xk,
    stride_ai, stride_as, stride_ar, stride_ak,
    stride_vj, stride_vi, stride_vt, stride_vr,
    stride_ranks_i,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr, K_MULT16: tl.constexpr, EVEN_K: tl.constexpr, PARTS: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr, SEG_BLOCK: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:  # the expand behind may be scheduled now; it waits for v itself (expand.py)
        gdc_launch_dependents()
    pid_seg, pid_m = token_tile(seg_len_ptr, n_segments, BLOCK_M, SEG_BLOCK)
    pid_z = tl.program_id(2)
    pid_k = pid_z % SPLIT_K
    pid_n = (pid_z // SPLIT_K) % (n_rank_tiles * PARTS)
    pid_i = pid_z // (SPLIT_K * n_rank_tiles * PARTS)
    part = pid_n // n_rank_tiles
    pid_n = pid_n % n_rank_tiles
    # The metadata loads are independent, so they are all issued before the one exit test:
    # a chain of load-test-load would put their latencies in series at the start of every program.
    seg_len = tl.load(seg_len_ptr + pid_seg)
    seg_start = tl.load(seg_start_ptr + pid_seg)
    slot = tl.load(seg_slot_ptr + pid_seg)
    if PARTS == 2:  # own adapter, then (mixture) the mixed-in one
        slot = tl.where(part == 1, tl.load(mix_ptr), slot)  # slot -2 (no own adapter): rank 0 below
    rank = tl.load(ranks_ptr + pid_i * stride_ranks_i + tl.maximum(slot, 0))
    rank = tl.where(slot >= 0, rank, 0)
    if (pid_m * BLOCK_M >= seg_len) | (pid_n * BLOCK_N >= rank):
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    tokens = tl.load(token_order_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    # Bounds with known divisibility let Triton issue 16-byte loads: columns between the rank
    # and the next multiple of 16 are zero in the pool (its contract), so they add exact zeros.
    rank16 = tl.multiple_of((rank + 15) // 16 * 16, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < rank16
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    if K_MULT16:
        k_end = tl.multiple_of(k_end, 16)
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tokens[:, None] * stride_xt + (k_start + offs_k)[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    a_base = a_ptr + pid_i.to(tl.int64) * stride_ai + slot.to(tl.int64) * stride_as
    a_ptrs = a_base + offs_n[:, None] * stride_ar + (k_start + offs_k)[None, :] * stride_ak  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        x = k_step(x_ptrs, mask_m, k + offs_k, k_end, EVEN_K)
        acc = dot_nt(acc, x, k_step(a_ptrs, mask_n, k + offs_k, k_end, EVEN_K), UPCAST_DOT)  # rows of A
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak

    v_cols = part * max_rank + offs_n  # the mixed-in half sits past the own half
    v_ptrs = v_ptr + pid_k * stride_vj + pid_i * stride_vi + tokens[:, None] * stride_vt + v_cols[None, :] * stride_vr
    tl.store(v_ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


def check_lora_inputs(x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"x must be float16 or bfloat16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, in_features], got shape {tuple(x.shape)}")
    if lora_a.dim() != 4 or lora_a.shape[-1] != x.shape[1]:
        raise ValueError(f"lora_a must be [slices, slots, max_rank, in_features={x.shape[1]}], "
                         f"got {tuple(lora_a.shape)}")
    if lora_a.shape[2] % 16:
        raise ValueError(f"lora_a's max_rank ({lora_a.shape[2]}) must be a multiple of 16: pad the pool")
    if lora_a.dtype != x.dtype:
        raise TypeError(f"lora_a dtype {lora_a.dtype} differs from x dtype {x.dtype}")
    if tuple(ranks.shape) != tuple(lora_a.shape[:2]) or ranks.dtype != torch.int32:
        raise ValueError(f"ranks must be int32 [slices, slots] = {tuple(lora_a.shape[:2])}, "
                         f"got {ranks.dtype} {tuple(ranks.shape)}")
    for name, t in (("lora_a", lora_a), ("ranks", ranks)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if lora_a.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("x and lora_a need a contiguous last dimension")


def v_shape(x: torch.Tensor, lora_a: torch.Tensor, meta: SegmentMeta, config: TileConfig) -> tuple[int, ...]:
    """The shape of the v `shrink` writes: [splits, slices, tokens, max_rank (x2 for a mixture)]."""
    n_slices, _, max_rank, _ = lora_a.shape
    return config.split_k, n_slices, x.shape[0], max_rank * (1 if meta.mix_slot is None else 2)


def shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: SegmentMeta, ranks: torch.Tensor,
           config: TileConfig, out: torch.Tensor | None = None, launch_dependents: bool = False,
           flat: bool | None = None) -> torch.Tensor:
    """v = x @ A[slot].T per segment, as split-K partial sums: float32 [splits, slices, tokens, max_rank]
    ([..., 2 * max_rank] for a mixture batch: x @ A[mix].T in the second half).

    x: [T, K] fp16/bf16; lora_a: [slices, slots, R, K] (the pool, PEFT's lora_A layout, R a
    multiple of 16, rows past each adapter's rank zero); ranks: int32 [slices, slots].
    Rows of v for tokens without LoRA are left unwritten.
    out: a preallocated v of that shape (reused across layers in the engine).
    launch_dependents: let a kernel launched behind this one with programmatic dependent launch
    start before this one ends (`expand(pdl=True)`; needs `interpreter.pdl_available`).
    flat: the token tiles' layout on the grid (`token_tiles.seg_block`; None: the one that
    launches fewer programs).
    """
    check_lora_inputs(x, lora_a, ranks)
    check_slots(meta, lora_a.shape[1])
    n_slices, _, max_rank, k = lora_a.shape
    mix = meta.mix_slot is not None
    shape = v_shape(x, lora_a, meta, config)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=x.device)
    elif tuple(out.shape) != shape or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 {shape}, got {out.dtype} {tuple(out.shape)}")
    if meta.num_segments == 0 or meta.max_seg_len == 0:
        return out
    n_rank_tiles = triton.cdiv(max_rank, config.block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    block = seg_block(meta, config.block_m, flat)
    grid = (*token_grid(meta, config.block_m, block), n_slices * n_rank_tiles * (2 if mix else 1) * config.split_k)
    _shrink_kernel[grid](
        x, lora_a, out, meta.token_order, meta.seg_slot, meta.seg_start, meta.seg_len, ranks,
        meta.mix_slot if mix else meta.seg_slot,  # unread without MIX
        k, k_per_split, n_rank_tiles, max_rank, meta.num_segments,
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), lora_a.stride(3),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        ranks.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
        UPCAST_DOT=interpreted(), K_MULT16=k % 16 == 0, EVEN_K=k % (config.block_k * config.split_k) == 0,
        PARTS=2 if mix else 1, LAUNCH_DEPENDENTS=launch_dependents, SEG_BLOCK=block,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
