"""Paged decode attention (Triton): one query token per sequence over a paged K/V cache.

    for every sequence s, kv head g, query head h of g's group (h = g * GROUP + i):
        keys j in [0, context_lens[s]) at k_cache[block_tables[s, j // PAGE], j % PAGE, g]
        o[s, h] = softmax(scale * q[s, h] . k[j]) @ v[j]           (fp32 accumulation)

Grid: (sequences, kv heads). One program serves all query heads that share a kv head, as
the rows of one tile (grouped-query models read each K/V tile once, not GROUP times); the
group is padded to 16 rows for `tl.dot`. The grid depends only on the batch size and the loop
bound is read from `context_lens`, so a captured CUDA graph replays it for any lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE, FP8_MAX, SCALE_FLOOR
from kernels.fp8_fused import quantize_row
from kernels.interpreter import dot_nt, interpreted

from .prefill_kernel import check_paged_inputs


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_tables_ptr, context_lens_ptr, q8_ptr, s8_ptr,
    scale_log2,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, stride_q8, stride_s8,
    FP8_OUT: tl.constexpr, FP8_LIMIT: tl.constexpr, FLOOR: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    pid_s = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.load(context_lens_ptr + pid_s)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + pid_s.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    table = block_tables_ptr + pid_s.to(tl.int64) * stride_bt
    for start_n in range(0, ctx_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ctx_len
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
    out = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
    o_mask = mask_g[:, None] & mask_d[None, :]
    tl.store(o_ptr + pid_s.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :], out, mask=o_mask)
    if FP8_OUT:  # the group's FP8 copy of the output as written; padded rows (not heads) hold 0
        cols = tl.reshape(heads[:, None] * HEAD_DIM + offs_d[None, :], (BLOCK_G * BLOCK_D,))
        values = tl.reshape(tl.where(o_mask, out.to(tl.float32), 0.0), (BLOCK_G * BLOCK_D,))
        quantize_row(values, q8_ptr + pid_s.to(tl.int64) * stride_q8, s8_ptr + pid_s * stride_s8 + kv_head, cols,
                     tl.reshape(o_mask, (BLOCK_G * BLOCK_D,)), FP8_LIMIT, FLOOR)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 block_n: int | None = None, fp8_rows: bool = False):
    """o: [B, H, D] for q: [B, H, D] (one token per sequence); caches [num_blocks, PAGE, KVH, D];
    block_tables: int32 [B, max_blocks]; context_lens: int32 [B], each >= 1 (it counts the new token).
    fp8_rows: also o's FP8 copy, (q8 [B, H * D] float8_e4m3fn, scales [B, KVH] fp32: one per kv head group),
    returned as (o, q8, scales)."""
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
        _paged_decode_kernel[(n_seqs, n_kv_heads)](
            q, k_cache, v_cache, out, block_tables, context_lens, q8, s8,
            scale * 1.4426950408889634,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), q8.stride(0),
            s8.stride(0), FP8_OUT=fp8_rows, FP8_LIMIT=FP8_MAX, FLOOR=SCALE_FLOOR, GROUP=group, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
            BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)), UPCAST_DOT=small, num_warps=4, num_stages=2,
        )
    if not fp8_rows:
        return out
    return out, (q8.to(FP8_DTYPE) if q8.dtype != FP8_DTYPE else q8), s8
