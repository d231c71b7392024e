"""Punica's SGMV and S-LoRA's MBGMV (vlora_kernels/baselines.py) against the fp32 reference (CPU: through the
Triton interpreter), their place in the kernel benchmark, and the benchmark's latency percentiles."""

from __future__ import annotations

import functools

import pytest
import torch
from lora_cases import make_batch, make_pool, rel_err

from vlora_kernels.baselines import lora_mbgmv, lora_sgmv
from vlora_kernels.reference import lora_reference
from vlora_kernels.workload import token_slots

# the shrink's K split in 16-feature programs, so that the split-K sums are exercised at test sizes
sgmv_split_k = functools.partial(lora_sgmv, k_per_split=16)
OPS = pytest.mark.parametrize("op", [lora_sgmv, sgmv_split_k, lora_mbgmv], ids=["sgmv", "sgmv_split_k", "mbgmv"])
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _mix(mix: str, n: int) -> list[int]:
    if mix == "with_no_lora":  # every third token without LoRA, between tokens of 5 adapters out of order
        return [-1 if i % 3 == 1 else i * 7 % 5 for i in range(n)]
    return token_slots(n, mix)


def _compare(op, slot_ids, slices, k, max_rank, dtype=torch.float32, seed=0, **pool_kw):
    n_slots = max(max(slot_ids), 0) + 1
    lora_a, lora_b, ranks, scales = make_pool(n_slots, slices, k, max_rank, dtype, seed, **pool_kw)
    x, y0, meta = make_batch(len(slot_ids), k, sum(slices), slot_ids, dtype, seed)
    ref = lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    out = op(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    lora_rows = torch.tensor(slot_ids, device=out.device) >= 0
    assert torch.equal(out[~lora_rows], y0[~lora_rows]), "tokens without LoRA are untouched"
    assert not torch.equal(ref[lora_rows], y0[lora_rows]), "the case must change y"
    assert rel_err(out[lora_rows] - y0[lora_rows], ref[lora_rows] - y0[lora_rows]) < TOL[dtype]


@OPS
@pytest.mark.parametrize("mix", ["identical", "distinct", "skewed", "with_no_lora"])
@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_matches_reference_over_token_counts_and_mixes(op, mix, tokens):
    """Fused q/k/v slices, K not a multiple of 16, ranks below the pool's 32, some slices untargeted."""
    _compare(op, _mix(mix, tokens), (48, 16, 16), 40, 32, seed=tokens, rank_choices=[1, 5, 16, 32], untargeted=0.2)


@OPS
def test_ranks_1_to_128_mixed_in_one_batch(op):
    ranks = [1, 7, 8, 16, 33, 64, 100, 128]
    slot_ids = [i % len(ranks) for i in range(19)] + [-1]
    _compare(op, slot_ids, (32, 16), 48, 128, seed=3, rank_choices=ranks)


@OPS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precisions(op, dtype):
    _compare(op, [2, 0, -1, 2, 1, 1, 3, -1, 0], (48, 16, 16), 33, 16, dtype, seed=5)


@pytest.mark.parametrize("op", [lora_sgmv, lora_mbgmv], ids=["sgmv", "mbgmv"])
def test_padded_metadata_and_an_empty_batch(op):
    slices, slot_ids = (32,), [2, 0, 2, -1, 1]
    lora_a, lora_b, ranks, scales = make_pool(3, slices, 32, 16, torch.float32, seed=6)
    x, y0, meta = make_batch(5, 32, 32, slot_ids, torch.float32, seed=6)
    _, _, padded = make_batch(5, 32, 32, slot_ids, torch.float32, seed=6, max_segments=4, max_tokens=8)
    a = op(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    assert torch.equal(a, op(y0.clone(), x, lora_a, lora_b, padded, ranks, scales, slices))
    _, _, none = make_batch(5, 32, 32, [-1] * 5, torch.float32, seed=6)
    assert torch.equal(op(y0.clone(), x, lora_a, lora_b, none, ranks, scales, slices), y0)


@pytest.mark.parametrize("op", [lora_sgmv, sgmv_split_k, lora_mbgmv], ids=["sgmv", "sgmv_split_k", "mbgmv"])
def test_intermediate_starts_as_nan(op, monkeypatch):
    """v poisoned where the op allocates it uninitialised: what it reads must have been written."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    _compare(op, [1, 0, 1, 2, -1, 2, 2], (24, 8), 40, 32, seed=7, rank_choices=[3, 17, 32], untargeted=0.3)


def test_sgmv_works_at_the_padded_rank_and_mbgmv_at_the_real_one():
    """Garbage past each adapter's rank (the pool promises zeros there): MBGMV never reads it,
    SGMV multiplies the whole padded rank and picks it up."""
    slices, slot_ids = (32,), [0, 1, 1, 0]
    lora_a, lora_b, ranks, scales = make_pool(2, slices, 32, 32, torch.float32, seed=8, rank_choices=[4, 9])
    for s in range(2):
        r = int(ranks[0, s])
        lora_a[0, s, r:] = 3.0
        lora_b[s, :, r:] = 3.0
    x, y0, meta = make_batch(4, 32, 32, slot_ids, torch.float32, seed=8)
    ref = lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    assert rel_err(lora_mbgmv(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices) - y0, ref - y0) < 1e-5
    assert rel_err(lora_sgmv(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices) - y0, ref - y0) > 1


@pytest.mark.parametrize("op", [lora_sgmv, lora_mbgmv], ids=["sgmv", "mbgmv"])
def test_mixture_and_bad_inputs_are_refused(op):
    lora_a, lora_b, ranks, scales = make_pool(2, (32,), 32, 16, torch.float32, seed=0)
    x, y, meta = make_batch(4, 32, 32, [0, 1, -2, 1], torch.float32, seed=0, mix_slot=1)
    with pytest.raises(NotImplementedError, match="no mixture"):
        op(y, x, lora_a, lora_b, meta, ranks, scales, (32,))
    x, y, meta = make_batch(4, 32, 32, [0, 1, 0, 1], torch.float32, seed=0)
    with pytest.raises(TypeError, match="share one dtype"):
        op(y, x.half(), lora_a, lora_b, meta, ranks, scales, (32,))
    with pytest.raises(ValueError, match=r"lora_b \(2, 32, 8\)"):
        op(y, x, lora_a, lora_b[:, :, :8], meta, ranks, scales, (32,))
    with pytest.raises(ValueError, match="slices"):
        op(y, x, lora_a, lora_b, meta, ranks, scales, (16, 16))
    with pytest.raises(TypeError, match="ranks must be int32"):
        op(y, x, lora_a, lora_b, meta, ranks.long(), scales, (32,))


def test_benchmark_times_every_baseline_and_each_matches_the_reference():
    from bench.kernels import BASELINES, BenchJob

    assert {"sgmv", "mbgmv"} <= set(BASELINES) and BenchJob([1], ["distinct"], [16], [64], "out").baselines == list(
        BASELINES)
    slot_ids, slices = [3, 3, -1, 0, 1, 1, 1, 2, -1, 0], (24, 8, 8)
    lora_a, lora_b, ranks, scales = make_pool(4, slices, 32, 16, torch.float32, seed=9, untargeted=0.3)
    x, y0, meta = make_batch(len(slot_ids), 32, sum(slices), slot_ids, torch.float32, seed=9)
    ref = lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    for name, impl in BASELINES.items():
        out = impl(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
        assert rel_err(out - y0, ref - y0) < 1e-5, name


def test_latency_percentiles():
    from vlora_kernels.timing import latency_stats

    samples = [float(v) for v in range(100, 0, -1)]  # 1..100 in any order
    stats = latency_stats(samples)
    assert stats == pytest.approx(dict(us=50.5, p50_us=50.5, p90_us=90.1, p99_us=99.01))
    assert latency_stats([7.0]) == dict(us=7.0, p50_us=7.0, p90_us=7.0, p99_us=7.0)
    with pytest.raises(ValueError):
        latency_stats([])
