"""The attention layer over the paged K/V cache, with a plain-PyTorch path and Triton kernels.

    cache layout (one pair per layer): k_cache, v_cache: [num_blocks, block_size, KVH, D]
    token t of a sequence lives at slot block_table[t // block_size] * block_size + t % block_size

A forward stores the step's new K/V rows at `ctx.slot_mapping`, then attends each sequence's
query rows (its last `query_len` tokens) to its whole context, causally. Backends:
"torch" runs `scaled_dot_product_attention`: the one-token sequences of a step (decodes) in one call
over their contexts padded to the longest, the others one by one (CPU runs; `paged_attention_torch`, one
call per sequence, is the reference of the kernels); "triton" launches `paged_decode` when every sequence has one query
token and `paged_prefill` otherwise (mixed prefill/decode steps included).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .context import StepContext, get_context

BACKENDS = ("torch", "triton")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, KVH, D] written to their slots (int64 [T]); a CUDA-graph-safe index copy."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, KVH, D]: the first `length` cached rows of one sequence."""
    n_blocks = -(-length // cache.shape[1])
    return cache[block_table[:n_blocks].long()].flatten(0, 1)[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [n, H, D] (the last n of L positions), k, v: [L, KVH, D] -> [n, H, D], causal."""
    n, n_heads, _ = q.shape
    length = k.shape[0]
    group = n_heads // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    # query row i sits at position length - n + i and sees keys 0 .. that position
    visible = torch.arange(length, device=q.device)[None, :] <= (torch.arange(n, device=q.device) + length - n)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=visible, scale=scale)
    return out.transpose(0, 1)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_lens: list[int], context_lens: list[int],
                          scale: float) -> torch.Tensor:
    """The reference: q [T, H, D] with sequences' query rows back to back -> o [T, H, D]."""
    out = torch.empty_like(q)
    start = 0
    for i, (n, length) in enumerate(zip(query_lens, context_lens)):
        if n > length:
            raise ValueError(f"sequence {i}: query length {n} exceeds its context length {length}")
        k = gather_context(k_cache, block_tables[i], length)
        v = gather_context(v_cache, block_tables[i], length)
        out[start:start + n] = _attend(q[start:start + n], k, v, scale)
        start += n
    return out


def paged_attention_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_lens: list[int], context_lens: list[int],
                            scale: float) -> torch.Tensor:
    """`paged_attention_torch`'s result with the step's one-token sequences in one batched call. On a CPU each
    call costs about as much as a short sequence's arithmetic, so a step that carried a flood's decodes one call
    each grew by a pass of small calls per sequence; now by one padded row of the batch."""
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    if len(decodes) < 2:
        return paged_attention_torch(q, k_cache, v_cache, block_tables, query_lens, context_lens, scale)
    out = torch.empty_like(q)
    rows, start = [], 0
    for i, (n, length) in enumerate(zip(query_lens, context_lens)):
        if n > length:
            raise ValueError(f"sequence {i}: query length {n} exceeds its context length {length}")
        if n == 1:
            rows.append(start)
        else:
            k = gather_context(k_cache, block_tables[i], length)
            v = gather_context(v_cache, block_tables[i], length)
            out[start:start + n] = _attend(q[start:start + n], k, v, scale)
        start += n
    lens = [context_lens[i] for i in decodes]
    longest = max(lens)
    tables = block_tables[torch.tensor(decodes, device=block_tables.device), :-(-longest // k_cache.shape[1])].long()
    k = k_cache[tables].flatten(1, 2)[:, :longest].transpose(1, 2)  # [B, KVH, L, D]
    v = v_cache[tables].flatten(1, 2)[:, :longest].transpose(1, 2)
    rows_t = torch.tensor(rows, device=q.device)
    batch, n_heads, head_dim = len(rows), q.shape[1], q.shape[2]
    # one query row: head h reads kv head h // group, so the heads fold into [KVH, group] without copying K/V
    qd = q[rows_t].view(batch, k.shape[1], n_heads // k.shape[1], head_dim)
    visible = torch.arange(longest, device=q.device)[None, :] < torch.tensor(lens, device=q.device)[:, None]
    # written out rather than through scaled_dot_product_attention, whose masked CPU path took 3x as long at 32
    # sequences; the rows past a sequence's length (stale rows of its last block's earlier owner, or the
    # padding's block 0) are masked in the scores and zeroed in V, since a non-finite stale row times a zero
    # weight would still be NaN
    scores = torch.matmul(qd, k.transpose(2, 3)).float() * scale  # [B, KVH, group, L]
    weights = scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(-1).to(v.dtype)
    o = torch.matmul(weights, v.masked_fill(~visible[:, None, :, None], 0.0))
    out[rows_t] = o.reshape(batch, n_heads, head_dim)
    return out


def dense_causal_attention(q, k, v, query_lens: list[int], scale: float) -> torch.Tensor:
    """Attention of fresh sequences without a cache (memory profiling before the cache exists)."""
    out = torch.empty_like(q)
    start = 0
    for n in query_lens:
        out[start:start + n] = _attend(q[start:start + n], k[start:start + n], v[start:start + n], scale)
        start += n
    return out


class PagedAttention(nn.Module):
    """Causal attention of q [T, H, D] against the cache; the runner assigns k_cache / v_cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: str = "torch"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"attention backend {backend!r} is not one of {BACKENDS}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # FP8 o_proj next (serve/models/fp8.py fuse_quantization): the decode kernel also writes its output's
        # FP8 rows, one scale per (token, kv head group), attached to the output it returns
        self.fp8_output = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx: StepContext = get_context()
        if self.k_cache is None:
            return dense_causal_attention(q, k, v, ctx.query_lens_list, self.scale)
        store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        return self.attend(q)

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """q against the cache, this step's K/V rows already stored in it (by forward, or by the decoder's fused
        serve/models/fused.py rope_store)."""
        ctx: StepContext = get_context()
        if self.backend == "torch":
            return paged_attention_batched(q, self.k_cache, self.v_cache, ctx.block_tables,
                                           ctx.query_lens_list, ctx.context_lens_list, self.scale)
        from .decode_kernel import paged_decode
        from .prefill_kernel import paged_prefill

        if ctx.decode_only:
            if self.fp8_output and _group_rows_read(q):
                from vlora_kernels.fp8 import attach_rows

                o, q8, scales = paged_decode(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens,
                                             self.scale, fp8_rows=True)
                return attach_rows(o, q8, scales)
            return paged_decode(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens, self.scale)
        return paged_prefill(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.query_start,
                             ctx.context_lens, ctx.max_query_len, self.scale)


def _group_rows_read(q: torch.Tensor) -> bool:
    """Whether o_proj's FP8 GEMM reads per-group FP8 rows at this step's size (vlora_kernels/fp8.py group_rows_read)."""
    from vlora_kernels.fp8 import group_rows_read

    return group_rows_read(q)
