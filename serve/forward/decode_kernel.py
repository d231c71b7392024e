"""Paged decode attention (Triton): one query token per sequence over a paged K/V cache.

    for every sequence s, kv head g, query head h of g's group (h = g * GROUP + i):
        keys j in [0, context_lens[s]) at k_cache[block_tables[s, j // PAGE], j % PAGE, g]
        o[s, h] = softmax(scale * q[s, h] . k[j]) @ v[j]           (fp32 accumulation)

Grid: (sequences, kv heads). One program serves all query heads that share a kv head, as
the rows of one tile (grouped-query models read each K/V tile once, not GROUP times); the
group is padded to 16 rows for `tl.dot`. The grid depends only on the batch size and the loop
bound is read from `context_lens`, so a captured CUDA graph replays it for any lengths.

Split context (`decode_splits`): with few sequences that grid leaves most SMs idle (the 7B's 4 kv heads:
4 programs at batch 1, 128 at batch 32, on 132 SMs; on an H200 a layer's decode attention read 1 MB in 16 us
at batch 1). Then each context is cut into SPLITS chunks of whole BLOCK_N tiles, one program each
(`_paged_decode_split_kernel`: grid (sequences, kv heads, SPLITS)), which write their online-softmax state
(max, sum, unnormalized output); a second launch (`_paged_decode_combine_kernel`), with PDL where available,
rescales them to their common max and sums them in split order. The chunk size is computed on the device from
`context_lens`, so graphs replay it for any lengths; chunks past a short context write an empty state.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from vlora_kernels.fp8 import FP8_DTYPE, FP8_MAX, SCALE_FLOOR, quantize_row
from vlora_kernels.interpreter import (chain_in, dot_nt, gdc_launch_dependents, gdc_wait, interpreted, pdl_available,
                                      pdl_chained, pdl_launch)

from .prefill_kernel import check_paged_inputs

TARGET_PROGRAMS = 264  # two programs per SM of a 132-SM H100 / H200
MAX_SPLITS = 16
_POWERS = tuple(2 ** i for i in range(MAX_SPLITS.bit_length()))


@triton.jit
def _attend(q, k_cache_ptr, v_cache_ptr, table, kv_head, lo, hi, scale_log2, stride_kb, stride_ks, stride_kh,
            stride_vb, stride_vs, stride_vh, mask_d, offs_d, PAGE: tl.constexpr, BLOCK_G: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """Online softmax of q's rows over keys [lo, hi) of one sequence: (running max m, sum l, unnormalized acc),
    in log2 units; an empty range gives (-inf, 0, 0)."""
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        blocks = tl.load(table + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        in_page = offs_n % PAGE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + blocks[:, None] * stride_kb + in_page[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + blocks[:, None] * stride_vb + in_page[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot_nt(tl.zeros((BLOCK_G, BLOCK_N), dtype=tl.float32), q, k, UPCAST_DOT) * scale_log2
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot_nt(acc * alpha[:, None], p.to(v.dtype), tl.trans(v), UPCAST_DOT)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _group_query(q_ptr, block_tables_ptr, pid_s, kv_head, stride_qs, stride_qh, stride_bt, GROUP: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Sequence pid_s's query rows of kv head group kv_head ([BLOCK_G, BLOCK_D], padding 0), its block table row,
    the group's heads, the head-dim offsets with their mask, and the mask of real (head, dim) cells."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    o_mask = (offs_g < GROUP)[:, None] & mask_d[None, :]
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + pid_s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=o_mask,
                other=0.0)
    return q, block_tables_ptr + pid_s.to(tl.int64) * stride_bt, heads, offs_d, mask_d, o_mask


@triton.jit
def _store_output(out, o_ptr, q8_ptr, s8_ptr, pid_s, kv_head, heads, offs_d, o_mask, stride_os, stride_oh, stride_q8,
                  stride_s8, FP8_OUT: tl.constexpr, FP8_LIMIT: tl.constexpr, FLOOR: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The group's output rows in o's dtype; with FP8_OUT also their FP8 copy (padded rows, not heads, hold 0)."""
    out = out.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + pid_s.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :], out, mask=o_mask)
    if FP8_OUT:
        cols = tl.reshape(heads[:, None] * HEAD_DIM + offs_d[None, :], (BLOCK_G * BLOCK_D,))
        values = tl.reshape(tl.where(o_mask, out.to(tl.float32), 0.0), (BLOCK_G * BLOCK_D,))
        quantize_row(values, q8_ptr + pid_s.to(tl.int64) * stride_q8, s8_ptr + pid_s * stride_s8 + kv_head, cols,
                     tl.reshape(o_mask, (BLOCK_G * BLOCK_D,)), FP8_LIMIT, FLOOR)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_tables_ptr, context_lens_ptr, q8_ptr, s8_ptr,
    scale_log2,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, stride_q8, stride_s8,
    FP8_OUT: tl.constexpr, FP8_LIMIT: tl.constexpr, FLOOR: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr, CHAIN: tl.constexpr,
):
    # grid (sequences, kv heads): one program a group over the whole context
    chain_in(CHAIN)  # launched with PDL behind the cache's writes (interpreter.pdl_chained)
    pid_s = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + pid_s)
    q, table, heads, offs_d, mask_d, o_mask = _group_query(q_ptr, block_tables_ptr, pid_s, kv_head, stride_qs,
                                                           stride_qh, stride_bt, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D)
    m_i, l_i, acc = _attend(q, k_cache_ptr, v_cache_ptr, table, kv_head, 0, ctx_len, scale_log2, stride_kb, stride_ks,
                            stride_kh, stride_vb, stride_vs, stride_vh, mask_d, offs_d, PAGE, BLOCK_G, BLOCK_N, BLOCK_D,
                            UPCAST_DOT)
    _store_output(acc / l_i[:, None], o_ptr, q8_ptr, s8_ptr, pid_s, kv_head, heads, offs_d, o_mask, stride_os,
                  stride_oh, stride_q8, stride_s8, FP8_OUT, FP8_LIMIT, FLOOR, HEAD_DIM, BLOCK_G, BLOCK_D)


@triton.jit
def _paged_decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, acc_ptr, ml_ptr, scale_log2,
    stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    SPLITS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST_DOT: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
    WAIT: tl.constexpr,
):
    # grid (sequences, kv heads, SPLITS): split i takes the context's i-th chunk of whole BLOCK_N tiles and writes
    # its (m, l, unnormalized acc) for _paged_decode_combine_kernel; a chunk past the context writes (-inf, 0, 0)
    if LAUNCH_DEPENDENTS:  # the combine behind may be scheduled now; it waits for the partials itself
        gdc_launch_dependents()
    if WAIT:  # launched with PDL behind the cache's writes (interpreter.pdl_chained): q and the caches written
        gdc_wait()
    pid_s, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx_len = tl.load(context_lens_ptr + pid_s)
    chunk = tl.cdiv(tl.cdiv(ctx_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    q, table, _, offs_d, mask_d, _ = _group_query(q_ptr, block_tables_ptr, pid_s, kv_head, stride_qs, stride_qh,
                                                  stride_bt, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D)
    m_i, l_i, acc = _attend(q, k_cache_ptr, v_cache_ptr, table, kv_head, lo, tl.minimum(lo + chunk, ctx_len),
                            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, mask_d, offs_d,
                            PAGE, BLOCK_G, BLOCK_N, BLOCK_D, UPCAST_DOT)
    offs_g = tl.arange(0, BLOCK_G)
    part = (pid_s.to(tl.int64) * tl.num_programs(1) + kv_head) * SPLITS + split
    tl.store(acc_ptr + part * BLOCK_G * BLOCK_D + offs_g[:, None] * BLOCK_D + offs_d[None, :], acc)
    tl.store(ml_ptr + part * 2 * BLOCK_G + offs_g, m_i)
    tl.store(ml_ptr + part * 2 * BLOCK_G + BLOCK_G + offs_g, l_i)


@triton.jit
def _paged_decode_combine_kernel(
    acc_ptr, ml_ptr, o_ptr, q8_ptr, s8_ptr, stride_os, stride_oh, stride_q8, stride_s8,
    SPLITS: tl.constexpr, FP8_OUT: tl.constexpr, FP8_LIMIT: tl.constexpr, FLOOR: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    # grid (sequences, kv heads): the splits' partials rescaled to their common max and summed, in split order
    if LAUNCH_DEPENDENTS:  # o_proj's GEMM behind may launch and prefetch its weight; it waits for o itself
        gdc_launch_dependents()
    pid_s, kv_head = tl.program_id(0), tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    base = (pid_s.to(tl.int64) * tl.num_programs(1) + kv_head) * SPLITS
    if PDL:
        gdc_wait()  # launched behind the split kernel with PDL: every partial written and visible past here
    sp = tl.arange(0, SPLITS)
    m = tl.load(ml_ptr + (base + sp)[:, None] * 2 * BLOCK_G + offs_g[None, :])  # [SPLITS, BLOCK_G]
    m_max = tl.max(m, 0)  # finite: split 0 holds at least one key
    l_sum = tl.sum(tl.exp2(m - m_max[None, :]) * tl.load(ml_ptr + (base + sp)[:, None] * 2 * BLOCK_G + BLOCK_G
                                                          + offs_g[None, :]), 0)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for i in tl.static_range(SPLITS):
        w = tl.exp2(tl.load(ml_ptr + (base + i) * 2 * BLOCK_G + offs_g) - m_max)  # 0 for an empty split
        acc += tl.load(acc_ptr + (base + i) * BLOCK_G * BLOCK_D + offs_g[:, None] * BLOCK_D + offs_d[None, :]) * w[:, None]
    heads = kv_head * GROUP + offs_g
    _store_output(acc / l_sum[:, None], o_ptr, q8_ptr, s8_ptr, pid_s, kv_head, heads, offs_d,
                  (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :], stride_os, stride_oh, stride_q8, stride_s8,
                  FP8_OUT, FP8_LIMIT, FLOOR, HEAD_DIM, BLOCK_G, BLOCK_D)


def decode_splits(n_seqs: int, n_kv_heads: int, override: int | None = None, interpreter: bool = False) -> int:
    """Splits of each sequence's context for a decode step of n_seqs: 1 (one program a group) where
    sequences x kv heads already give TARGET_PROGRAMS, else the power of two that reaches it, at most MAX_SPLITS.
    override (DECODE_SPLITS, from VLORA_DECODE_SPLITS, or paged_decode's `splits`) wins. In the interpreter 1
    unless overridden: it runs programs one by one, so splits only add work there (the tests ask for them)."""
    if override is not None:
        if override not in _POWERS:
            raise ValueError(f"decode splits must be a power of two from 1 to {MAX_SPLITS}, got {override!r}")
        return override
    if interpreter:
        return 1
    programs = max(1, n_seqs * n_kv_heads)
    return 1 if programs >= TARGET_PROGRAMS else min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS,
                                                                                                   programs)))


def _splits_override(environ=None) -> int | None:
    raw = (os.environ if environ is None else environ).get("VLORA_DECODE_SPLITS", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) not in _POWERS:
        raise ValueError(f"VLORA_DECODE_SPLITS must be a power of two from 1 to {MAX_SPLITS}, got {raw!r}")
    return int(raw)


# Read once at import: the bench's A/B of the split (1: one program a kv head group, as before)
DECODE_SPLITS = _splits_override()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 block_n: int | None = None, fp8_rows: bool = False, splits: int | None = None):
    """o: [B, H, D] for q: [B, H, D] (one token per sequence); caches [num_blocks, PAGE, KVH, D];
    block_tables: int32 [B, max_blocks]; context_lens: int32 [B], each >= 1 (it counts the new token).
    fp8_rows: also o's FP8 copy, (q8 [B, H * D] float8_e4m3fn, scales [B, KVH] fp32: one per kv head group),
    returned as (o, q8, scales). splits: of each context (a power of two; None: `decode_splits`' choice)."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    if q.shape[0] != context_lens.shape[0]:
        raise ValueError(f"decode needs one query row per sequence: q has {q.shape[0]}, "
                         f"context_lens {context_lens.shape[0]}")
    out = torch.empty_like(q) if out is None else out
    n_seqs, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    small = interpreted()
    if fp8_rows:  # the interpreter rounds float32 -> e4m3 wrongly: there torch casts what the kernel writes
        q8 = torch.empty((n_seqs, n_heads * head_dim), dtype=torch.float32 if small else FP8_DTYPE, device=q.device)
        s8 = torch.empty((n_seqs, n_kv_heads), dtype=torch.float32, device=q.device)
    else:
        q8 = s8 = out  # pointers the kernel never reads
    if n_seqs:
        group = n_heads // n_kv_heads
        block_n = block_n or (16 if small else 64)
        block_g, block_d = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(head_dim))
        shape = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g, BLOCK_D=block_d)
        fp8 = dict(FP8_OUT=fp8_rows, FP8_LIMIT=FP8_MAX, FLOOR=SCALE_FLOOR)
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
                         v_cache.stride(2), block_tables.stride(0))
        splits = decode_splits(n_seqs, n_kv_heads, DECODE_SPLITS if splits is None else splits, small)
        chain = pdl_chained(q.device)
        if splits == 1:
            _paged_decode_kernel[(n_seqs, n_kv_heads)](
                q, k_cache, v_cache, out, block_tables, context_lens, q8, s8, scale * 1.4426950408889634,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides, q8.stride(0), s8.stride(0),
                **fp8, **shape, PAGE=k_cache.shape[1], BLOCK_N=block_n, UPCAST_DOT=small, CHAIN=chain, num_warps=4,
                num_stages=2, **pdl_launch(chain))
        else:  # partials: [seqs, kv heads, splits] x (acc [BLOCK_G, BLOCK_D], m and l [BLOCK_G]), fp32, in L2
            acc = torch.empty((n_seqs, n_kv_heads, splits, block_g, block_d), dtype=torch.float32, device=q.device)
            ml = torch.empty((n_seqs, n_kv_heads, splits, 2, block_g), dtype=torch.float32, device=q.device)
            pdl = pdl_available(q.device)
            _paged_decode_split_kernel[(n_seqs, n_kv_heads, splits)](
                q, k_cache, v_cache, block_tables, context_lens, acc, ml, scale * 1.4426950408889634, q.stride(0),
                q.stride(1), *cache_strides, SPLITS=splits, **shape, PAGE=k_cache.shape[1], BLOCK_N=block_n,
                UPCAST_DOT=small, LAUNCH_DEPENDENTS=pdl, WAIT=chain, num_warps=4, num_stages=2, **pdl_launch(chain))
            _paged_decode_combine_kernel[(n_seqs, n_kv_heads)](
                acc, ml, out, q8, s8, out.stride(0), out.stride(1), q8.stride(0), s8.stride(0), SPLITS=splits, **fp8,
                **shape, PDL=pdl, LAUNCH_DEPENDENTS=chain, num_warps=4, **pdl_launch(pdl))
    if not fp8_rows:
        return out
    return out, (q8.to(FP8_DTYPE) if q8.dtype != FP8_DTYPE else q8), s8
