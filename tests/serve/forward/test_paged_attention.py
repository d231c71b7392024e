"""Paged attention: Triton prefill/decode kernels (interpreter on CPU, compiled on a GPU) against the PyTorch
reference, and the reference against dense causal attention of the unpaged sequences."""

from __future__ import annotations

import math

import pytest
import torch

from serve.forward.attention import paged_attention_batched, paged_attention_torch, store_kv
from serve.forward.decode_kernel import paged_decode
from serve.forward.prefill_kernel import paged_prefill

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels compiled on a GPU, interpreted on the CPU
# a GPU's tl.dot multiplies float32 tiles as TF32 (10 mantissa bits); the interpreter multiplies them exactly
TOL = 2e-3 if DEV == "cuda" else 1e-4


def _lens(lens) -> torch.Tensor:
    return torch.tensor(lens, dtype=torch.int32, device=DEV)


def _paged_case(context_lens, query_lens, n_heads, n_kv_heads, head_dim, page, dtype=torch.float32, seed=0):
    """Random K/V for each sequence scattered over shuffled cache blocks; queries for the last rows."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-c // page) for c in context_lens) + 3
    k_cache = torch.randn(n_blocks, page, n_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(n_blocks, page, n_kv_heads, head_dim, generator=g).to(dtype)
    free = torch.randperm(n_blocks, generator=g).tolist()
    max_blocks = max(-(-c // page) for c in context_lens)
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    keys, values = [], []
    for i, c in enumerate(context_lens):
        nb = -(-c // page)
        tables[i, :nb] = torch.tensor([free.pop() for _ in range(nb)], dtype=torch.int32)
        k = torch.randn(c, n_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(c, n_kv_heads, head_dim, generator=g).to(dtype)
        slots = (tables[i, torch.arange(c) // page].long() * page + torch.arange(c) % page)
        store_kv(k, v, k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)
    q = torch.randn(sum(query_lens), n_heads, head_dim, generator=g).to(dtype)
    query_start = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    return (*(t.to(DEV) for t in (q, k_cache, v_cache, tables, query_start)), keys, values)


def _dense(q, keys, values, query_lens, n_heads):
    """fp32 attention of each sequence's last query rows over its unpaged K/V."""
    out, start, q = [], 0, q.cpu()
    for n, k, v in zip(query_lens, keys, values):
        group = n_heads // k.shape[1]
        k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        qs = q[start:start + n].float()
        scores = torch.einsum("qhd,khd->hqk", qs, k) / math.sqrt(q.shape[-1])
        pos = torch.arange(k.shape[0] - n, k.shape[0])
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, None, :] > pos[None, :, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += n
    return torch.cat(out)


CASES = [  # (context lens, query lens, heads, kv heads, head dim, page)
    ([5], [5], 4, 4, 32, 16),  # a short fresh prompt
    ([37, 1, 16, 50], [37, 1, 3, 17], 4, 2, 32, 16),  # fresh, one-token, chunk after cache, odd lengths; GQA
    ([70, 33], [1, 33], 8, 1, 16, 8),  # MQA, small pages, decode row beside a prefill
    ([40, 29], [20, 29], 6, 2, 24, 16),  # head dim not a power of two
]


@pytest.mark.parametrize("context_lens,query_lens,n_heads,n_kv_heads,head_dim,page", CASES)
def test_reference_matches_dense_attention(context_lens, query_lens, n_heads, n_kv_heads, head_dim, page):
    q, kc, vc, tables, _, keys, values = _paged_case(context_lens, query_lens, n_heads, n_kv_heads, head_dim, page)
    got = paged_attention_torch(q, kc, vc, tables, query_lens, context_lens, 1 / math.sqrt(head_dim))
    torch.testing.assert_close(got.cpu(), _dense(q, keys, values, query_lens, n_heads), atol=1e-5, rtol=1e-5)


BATCHED_CASES = CASES + [  # several one-token sequences, which the CPU path attends in one call
    ([9, 64, 33, 1], [1, 1, 1, 1], 4, 2, 32, 16),  # decodes only: a page's end, one row, one token of context
    ([40, 120, 7, 50, 16], [12, 1, 1, 50, 1], 8, 1, 16, 8),  # decodes among a chunk and a fresh prompt; MQA
    ([30, 31], [1, 1], 6, 6, 24, 16),  # two decodes, no grouping, head dim not a power of two
]


@pytest.mark.parametrize("context_lens,query_lens,n_heads,n_kv_heads,head_dim,page", BATCHED_CASES)
def test_the_batched_path_matches_dense_attention(context_lens, query_lens, n_heads, n_kv_heads, head_dim, page):
    q, kc, vc, tables, _, keys, values = _paged_case(context_lens, query_lens, n_heads, n_kv_heads, head_dim, page)
    got = paged_attention_batched(q, kc, vc, tables, query_lens, context_lens, 1 / math.sqrt(head_dim))
    torch.testing.assert_close(got.cpu(), _dense(q, keys, values, query_lens, n_heads), atol=1e-5, rtol=1e-5)


def test_stale_non_finite_rows_past_a_sequence_do_not_reach_its_output():
    """The batched decodes read whole blocks: the rows past each sequence's length (an earlier owner's, or the
    padding's block 0) are masked, and a NaN or inf there must not leak into any sequence's output."""
    context_lens, query_lens = [5, 21, 3], [1, 1, 1]
    q, kc, vc, tables, _, keys, values = _paged_case(context_lens, query_lens, 4, 2, 32, 16)
    used = {(int(b), r) for i, c in enumerate(context_lens) for b, r in
            ((tables[i, t // 16], t % 16) for t in range(c))}
    for b in range(kc.shape[0]):
        for r in range(16):
            if (b, r) not in used:
                kc[b, r], vc[b, r] = float("nan"), float("inf")
    got = paged_attention_batched(q, kc, vc, tables, query_lens, context_lens, 32 ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu(), _dense(q, keys, values, query_lens, 4), atol=1e-5, rtol=1e-5)


def test_the_batched_path_in_bfloat16_stays_within_its_rounding_of_fp32():
    """A real checkpoint is often bf16 and runs in bf16 on a CPU; the per-sequence reference lands 0.005-0.008 off
    fp32 on such steps, the batched path 0.005-0.011."""
    context_lens, query_lens = [40, 120, 7, 50, 16, 300], [12, 1, 1, 50, 1, 1]
    q, kc, vc, tables, _, keys, values = _paged_case(context_lens, query_lens, 8, 2, 32, 16, dtype=torch.bfloat16)
    got = paged_attention_batched(q, kc, vc, tables, query_lens, context_lens, 32 ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), _dense(q, keys, values, query_lens, 8), atol=2e-2, rtol=2e-2)


def test_the_batched_path_names_a_query_longer_than_its_context():
    q, kc, vc, tables, _, _, _ = _paged_case([8, 8, 8], [1, 1, 8], 4, 2, 32, 16)
    with pytest.raises(ValueError, match="sequence 2: query length 9 exceeds its context length 8"):
        paged_attention_batched(torch.cat([q, q[:1]]), kc, vc, tables, [1, 1, 9], [8, 8, 8], 1.0)


@pytest.mark.parametrize("context_lens,query_lens,n_heads,n_kv_heads,head_dim,page", CASES)
def test_prefill_kernel_matches_reference(context_lens, query_lens, n_heads, n_kv_heads, head_dim, page):
    q, kc, vc, tables, qs, keys, values = _paged_case(context_lens, query_lens, n_heads, n_kv_heads, head_dim, page)
    got = paged_prefill(q, kc, vc, tables, qs, _lens(context_lens), max(query_lens), 1 / math.sqrt(head_dim))
    torch.testing.assert_close(got.cpu(), _dense(q, keys, values, query_lens, n_heads), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("context_lens,n_heads,n_kv_heads,head_dim,page", [
    ([1, 17, 64, 5], 4, 2, 32, 16), ([100, 3], 7, 1, 32, 8), ([9], 4, 4, 16, 16)])
def test_decode_kernel_matches_reference(context_lens, n_heads, n_kv_heads, head_dim, page):
    query_lens = [1] * len(context_lens)
    q, kc, vc, tables, _, keys, values = _paged_case(context_lens, query_lens, n_heads, n_kv_heads, head_dim, page)
    got = paged_decode(q, kc, vc, tables, _lens(context_lens), 1 / math.sqrt(head_dim))
    torch.testing.assert_close(got.cpu(), _dense(q, keys, values, query_lens, n_heads), atol=TOL, rtol=TOL)


@pytest.mark.parametrize("splits", [2, 4, 16])
@pytest.mark.parametrize("context_lens,n_heads,n_kv_heads,head_dim,page", [
    ([1, 17, 64, 5], 4, 2, 32, 16), ([100, 3], 7, 1, 32, 8), ([33], 4, 4, 16, 16)])
def test_decode_kernel_split_over_the_context_matches_reference(context_lens, n_heads, n_kv_heads, head_dim, page,
                                                                 splits):
    """Each context cut into chunks of whole 16-token tiles (16 splits of a 1- or 3-token context: all but the first
    empty), their softmax states combined: the dense attention, and the one-program kernel's output to fp32
    rounding."""
    query_lens = [1] * len(context_lens)
    q, kc, vc, tables, _, keys, values = _paged_case(context_lens, query_lens, n_heads, n_kv_heads, head_dim, page)
    lens = _lens(context_lens)
    got = paged_decode(q, kc, vc, tables, lens, head_dim ** -0.5, splits=splits)
    torch.testing.assert_close(got.cpu(), _dense(q, keys, values, query_lens, n_heads), atol=TOL, rtol=TOL)
    torch.testing.assert_close(got, paged_decode(q, kc, vc, tables, lens, head_dim ** -0.5, splits=1),
                               atol=TOL / 10, rtol=TOL / 10)


def test_decode_splits_fill_the_gpu_with_few_sequences_and_come_from_the_environment():
    from serve.forward import decode_kernel as dk

    assert dk.decode_splits(32, 4) == 4 and dk.decode_splits(1, 4) == dk.MAX_SPLITS  # the 7B: 512 and 64 programs
    assert dk.decode_splits(64, 4) == 2 and dk.decode_splits(32, 32) == 1  # MHA at batch 32: 1,024 groups already
    assert dk.decode_splits(1, 4, interpreter=True) == 1 and dk.decode_splits(1, 4, 8, interpreter=True) == 8
    assert dk._splits_override({}) is None and dk._splits_override({"VLORA_DECODE_SPLITS": "4"}) == 4
    for bad in ("3", "32", "x", "-1"):
        with pytest.raises(ValueError, match="VLORA_DECODE_SPLITS must be a power of two"):
            dk._splits_override({"VLORA_DECODE_SPLITS": bad})
    with pytest.raises(ValueError, match="power of two"):
        dk.decode_splits(1, 4, 6)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("context_lens,n_heads,n_kv_heads,head_dim", [
    ([1, 17, 64], 4, 2, 32), ([40, 3], 6, 2, 24), ([9, 70], 8, 8, 16)])  # GQA; head dim padded; MHA
def test_decode_kernel_writes_fp8_rows_of_its_output_one_scale_per_kv_head_group(context_lens, n_heads, n_kv_heads,
                                                                                 head_dim, splits):
    """fp8_rows: the output as without it, bit for bit, and its FP8 copy with one scale per (sequence, kv head
    group): quantize_rows_ref of the output's groups of GROUP * head_dim columns, byte for byte."""
    from vlora_kernels.fp8 import quantize_rows_ref

    query_lens = [1] * len(context_lens)
    q, kc, vc, tables = _paged_case(context_lens, query_lens, n_heads, n_kv_heads, head_dim, 16, dtype=torch.bfloat16)[:4]
    q = q * 4  # sharper attention: groups of different magnitudes
    lens = _lens(context_lens)
    plain = paged_decode(q, kc, vc, tables, lens, head_dim ** -0.5, splits=splits)
    out, q8, scales = paged_decode(q, kc, vc, tables, lens, head_dim ** -0.5, fp8_rows=True, splits=splits)
    assert torch.equal(out, plain)
    t, cols = len(context_lens), n_heads * head_dim
    assert q8.shape == (t, cols) and q8.dtype == torch.float8_e4m3fn and scales.shape == (t, n_kv_heads)
    want_q, want_s = quantize_rows_ref(out.reshape(t * n_kv_heads, cols // n_kv_heads))
    assert torch.equal(scales, want_s.reshape(t, n_kv_heads))
    assert torch.equal(q8.view(torch.uint8), want_q.reshape(t, cols).view(torch.uint8))


def test_kernels_in_bfloat16_stay_close_to_fp32():
    context_lens, query_lens = [33, 18], [33, 1]
    q, kc, vc, tables, qs, keys, values = _paged_case(context_lens, query_lens, 4, 2, 32, 16, dtype=torch.bfloat16)
    lens = _lens(context_lens)
    got = paged_prefill(q, kc, vc, tables, qs, lens, 33, 32 ** -0.5)
    want = _dense(q, keys, values, query_lens, 4)
    torch.testing.assert_close(got.float().cpu(), want, atol=3e-2, rtol=3e-2)
    dec = paged_decode(q[32:34].contiguous(), kc, vc, tables, lens, 32 ** -0.5)
    torch.testing.assert_close(dec[1].float().cpu(), want[33], atol=3e-2, rtol=3e-2)


def test_bad_inputs_are_named():
    q, kc, vc, tables, qs, _, _ = _paged_case([8], [8], 4, 2, 32, 16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_prefill(q[:, :3].contiguous(), kc, vc, tables, qs, _lens([8]), 8, 1.0)
    with pytest.raises(TypeError, match="int32"):
        paged_decode(q[:1], kc, vc, tables.long(), _lens([8]), 1.0)
    with pytest.raises(ValueError, match="one query row per sequence"):
        paged_decode(q[:2], kc, vc, tables, _lens([8]), 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32, 64])
def test_split_decode_at_the_7b_shape_on_a_gpu(batch):
    """28 heads in 4 kv groups of 128, contexts of 1-700 tokens, bf16: the split context (the choice of
    decode_splits: 16, 4 and 2 splits) against one program a group, and its FP8 rows against its output."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from vlora_kernels.fp8 import quantize_rows_ref

    lens = [1 + (i * 97) % 700 for i in range(batch)]
    q, kc, vc, tables, _, _, _ = _paged_case(lens, [1] * batch, 28, 4, 128, 16, dtype=torch.bfloat16, seed=batch)
    ctx = _lens(lens)
    one = paged_decode(q, kc, vc, tables, ctx, 128 ** -0.5, splits=1)
    out, q8, scales = paged_decode(q, kc, vc, tables, ctx, 128 ** -0.5, fp8_rows=True)
    torch.testing.assert_close(out.float(), one.float(), atol=2e-2, rtol=2e-2)
    want_q, want_s = quantize_rows_ref(out.reshape(batch * 4, 896))
    assert torch.equal(scales, want_s.reshape(batch, 4)) and torch.equal(q8.view(torch.uint8),
                                                                         want_q.reshape(batch, -1).view(torch.uint8))
