"""Paged prefill attention (Triton): variable-length causal queries over a paged K/V cache.

    for every sequence s, query head h (kv head g = h // GROUP), query row m of s:
        p = q_start[s] + m                       # absolute position of the query in s
        keys j in [0, p] of s live at k_cache[block_tables[s, j // PAGE], j % PAGE, g]
        o[row] = softmax(scale * q[row, h] . k[j]) @ v[j]        (fp32 accumulation)

A sequence's queries are its *last* `query_len` tokens, so one launch serves a fresh prompt
(context = query), a chunk of a long prompt after earlier chunks or a cached prefix
(context > query) and decode rows (query_len 1) mixed in the same step. Each sequence's new
K/V rows must already be in the cache (the attention layer stores them first).

Grid: (query tiles, query heads, sequences); programs past a sequence's query length exit.
Online softmax over key tiles as in FlashAttention; the loop stops at the tile's causal edge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlora_kernels.interpreter import dot_nt, interpreted


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    q_begin = tl.load(query_start_ptr + pid_s)
    q_len = tl.load(query_start_ptr + pid_s + 1) - q_begin
    ctx_len = tl.load(context_lens_ptr + pid_s)
    if pid_m * BLOCK_M >= q_len:
        return
    q_first_pos = ctx_len - q_len  # absolute position of the sequence's first query
    kv_head = pid_h // GROUP

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    rows = (q_begin + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + pid_h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    q_pos = q_first_pos + offs_m

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    # keys past the last query row of this tile are masked for every row: stop there
    end_n = tl.minimum(ctx_len, q_first_pos + (pid_m + 1) * BLOCK_M)
    table = block_tables_ptr + pid_s.to(tl.int64) * stride_bt
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ctx_len
        blocks = tl.load(table + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        in_page = offs_n % PAGE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + blocks[:, None] * stride_kb + in_page[:, None] * stride_ks
                    + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + blocks[:, None] * stride_vb + in_page[:, None] * stride_vs
                    + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot_nt(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), q, k, UPCAST_DOT) * scale_log2
        causal = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: key 0 is visible to every row
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = dot_nt(acc * alpha[:, None], p.to(v.dtype), tl.trans(v), UPCAST_DOT)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + rows[:, None] * stride_ot + pid_h * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def check_paged_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"q must be [T, H, D] and k/v caches [blocks, page, KVH, D] alike; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q heads {q.shape[1]} must be a multiple of kv heads {k_cache.shape[2]} "
                         f"and head dims must agree ({q.shape[2]} vs {k_cache.shape[3]})")
    if q.dtype != k_cache.dtype:
        raise TypeError(f"q dtype {q.dtype} differs from the cache dtype {k_cache.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous head dimension")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise TypeError("block_tables and context_lens must be int32")


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_start: torch.Tensor, context_lens: torch.Tensor, max_query_len: int, scale: float,
                  out: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None):
    """o: [T, H, D] for q: [T, H, D] (sequences' query rows back to back, `query_start` int32 [B + 1]);
    k_cache, v_cache: [num_blocks, PAGE, KVH, D]; block_tables: int32 [B, max_blocks];
    context_lens: int32 [B] (each >= its query length)."""
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    n_seqs = context_lens.shape[0]
    if query_start.shape[0] != n_seqs + 1:
        raise ValueError(f"query_start must have B + 1 = {n_seqs + 1} entries, got {query_start.shape[0]}")
    out = torch.empty_like(q) if out is None else out
    if n_seqs == 0 or max_query_len == 0:
        return out
    n_heads, head_dim = q.shape[1], q.shape[2]
    small = interpreted()  # the interpreter's cost grows with tile size; the GPU wants larger tiles
    block_m = block_m or (16 if small else 64)
    block_n = block_n or (16 if small else 64)
    grid = (triton.cdiv(max_query_len, block_m), n_heads, n_seqs)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start, context_lens,
        scale * 1.4426950408889634,  # log2(e): the kernel works in base 2
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=n_heads // k_cache.shape[2], HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        UPCAST_DOT=small, num_warps=4, num_stages=2,
    )
    return out
