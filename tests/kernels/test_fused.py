"""The fused one-launch ATMM kernel against the fp32 reference (CPU: through the Triton
interpreter), its tiling space, and the dispatch that picks it over shrink + expand."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lora_cases import make_batch, make_pool, rel_err

import vlora_kernels.lora
from vlora_kernels.fused import fused_add_lora
from vlora_kernels.lora import add_lora, one_launch_for
from vlora_kernels.reference import lora_reference
from vlora_kernels.table import TilingTable
from vlora_kernels.tiling import MAX_FUSED_GROUPS, TileConfig, config_space, heuristic_config, shape_key
from vlora_kernels.workload import token_slots

TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
# Small tiles, so the little test shapes still take several K steps, several column groups per
# slice and a last group shorter than col_tiles.
CFG = TileConfig(16, 16, 32, col_tiles=2)


def _junk_past_ranks(lora_a, lora_b, ranks, slices, seed):
    """Large values in A's rows and B's columns past each adapter's rank: the kernel must ignore them."""
    g = torch.Generator().manual_seed(seed)
    start = 0
    for i, width in enumerate(slices):
        for s, r in enumerate(ranks[i].tolist()):
            lora_a[i, s, r:] = (10 * torch.randn(lora_a[i, s, r:].shape, generator=g)).to(lora_a)
            lora_b[s, start:start + width, r:] = (10 * torch.randn(lora_b[s, start:start + width, r:].shape,
                                                                   generator=g)).to(lora_b)
        start += width


def _run(slot_ids, slices, k, max_rank, n_slots, dtype, seed, config=CFG, mix=None, junk=False, **pool_kw):
    """(y before, the fp32 reference, the fused kernel's y): y starts random, never zero."""
    lora_a, lora_b, ranks, scales = make_pool(n_slots, slices, k, max_rank, dtype, seed, **pool_kw)
    x, y0, meta = make_batch(len(slot_ids), k, sum(slices), slot_ids, dtype, seed, mix_slot=mix)
    ref = lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)  # reads ranks' rows only
    if junk:
        _junk_past_ranks(lora_a, lora_b, ranks, slices, seed)
    y = y0.clone()
    out = fused_add_lora(y, x, lora_a, lora_b, meta, ranks, scales, slices, config)
    assert out is y, "y is updated in place and returned"
    return y0, ref, out


def _check(y0, ref, out, slot_ids, dtype):
    touched = torch.tensor(slot_ids, device=out.device) != -1
    if touched.any():
        assert rel_err(out[touched] - y0[touched], ref[touched] - y0[touched]) < TOL[dtype]
    assert torch.equal(out[~touched], y0[~touched]), "tokens without LoRA are untouched"


def _slots(mix: str, tokens: int) -> list[int]:
    if mix == "one":
        return [3] * tokens
    if mix == "distinct":
        return list(range(tokens))
    if mix == "skewed":
        return token_slots(tokens, "skewed", seed=tokens)
    return [-1 if i % 3 == 1 else (5 * i) % 7 for i in range(tokens)]  # no-LoRA tokens interleaved


@pytest.mark.parametrize("tokens", [1, 3, 7, 16, 33])
@pytest.mark.parametrize("mix", ["one", "distinct", "skewed", "no_lora_interleaved"])
def test_matches_reference_over_token_counts_and_adapter_mixes(tokens, mix):
    slot_ids = _slots(mix, tokens)
    dtype = torch.bfloat16 if tokens % 2 else torch.float16
    _check(*_run(slot_ids, (48,), 64, 16, 40, dtype, seed=tokens), slot_ids, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k, slices", [(33, (48, 16, 16)), (40, (40, 24)), (64, (16,))])
@pytest.mark.parametrize("config", [CFG, TileConfig(32, 32, 64, num_warps=8, col_tiles=1)], ids=["cfg0", "cfg1"])
def test_fused_slices_odd_k_and_untargeted_slices(dtype, k, slices, config):
    slot_ids = [2, 0, -1, 2, 1, 3, -1, 0, 2, 2, 2]
    _check(*_run(slot_ids, slices, k, 32, 4, dtype, seed=k, config=config, untargeted=0.3), slot_ids, dtype)


def test_ranks_1_to_128_in_one_batch_ignore_junk_past_each_rank():
    ranks = [1, 7, 8, 16, 33, 64, 100, 128]
    slot_ids = [i % len(ranks) if i % 5 != 4 else -1 for i in range(20)]
    out = _run(slot_ids, (32, 16), 40, 128, len(ranks), torch.bfloat16, seed=3, rank_choices=ranks, junk=True,
               config=TileConfig(16, 16, 16, col_tiles=1))
    _check(*out, slot_ids, torch.bfloat16)


def test_pool_rank_below_the_padded_rank_ignores_junk():
    """A pool of max rank 48 runs with the rank padded to 64: rows 48..63 are outside the pool."""
    slot_ids = [0, 1, 2, 1, 0, -1, 2]
    out = _run(slot_ids, (32, 16), 33, 48, 3, torch.float16, seed=12, rank_choices=[5, 40, 48], junk=True)
    _check(*out, slot_ids, torch.float16)


def test_each_slot_takes_its_own_scale():
    """Changing one slot's scale changes its tokens only, as the reference says."""
    slot_ids, slices = [0, 1, 1, 2, 0, 1], (32,)
    lora_a, lora_b, ranks, scales = make_pool(3, slices, 32, 16, torch.float16, seed=5)
    x, y0, meta = make_batch(6, 32, 32, slot_ids, torch.float16, seed=5)
    changed = scales.clone()
    changed[1] *= -3
    base = fused_add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices, CFG)
    other = fused_add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, changed, slices, CFG)
    ref = lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, changed, slices)
    slot1 = torch.tensor(slot_ids, device=x.device) == 1
    assert torch.equal(other[~slot1], base[~slot1])
    assert rel_err(other[slot1] - y0[slot1], ref[slot1] - y0[slot1]) < TOL[torch.float16]


def test_padded_graph_metadata_and_empty_batches():
    slot_ids, slices = [2, 0, 2, -1, 1], (32,)
    lora_a, lora_b, ranks, scales = make_pool(4, slices, 32, 16, torch.float16, seed=5)
    x, y0, meta = make_batch(5, 32, 32, slot_ids, torch.float16, seed=5)
    _, _, padded = make_batch(5, 32, 32, slot_ids, torch.float16, seed=5, max_segments=4, max_tokens=8)
    a = fused_add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices, CFG)
    b = fused_add_lora(y0.clone(), x, lora_a, lora_b, padded, ranks, scales, slices, CFG)
    assert torch.equal(a, b)
    _, _, none = make_batch(5, 32, 32, [-1] * 5, torch.float16, seed=5)
    assert torch.equal(fused_add_lora(y0.clone(), x, lora_a, lora_b, none, ranks, scales, slices, CFG), y0)


@pytest.mark.parametrize("mix", [0, 5])  # a rank-1 and a rank-100 adapter mixed in
def test_mixture_subtracts_the_mixed_in_adapter(mix):
    ranks = [1, 7, 16, 33, 64, 100]
    slot_ids = [i % len(ranks) for i in range(9)] + [-2, -1, -2]  # own adapters, none (-1), mixed-in only (-2)
    out = _run(slot_ids, (32, 16), 48, 128, len(ranks), torch.bfloat16, seed=3, mix=mix, rank_choices=ranks,
               junk=True)
    _check(*out, slot_ids, torch.bfloat16)


def test_mixture_of_an_adapter_with_itself_cancels():
    lora_a, lora_b, ranks, scales = make_pool(3, (32,), 32, 16, torch.float16, seed=2)
    x, y0, meta = make_batch(6, 32, 32, [1] * 6, torch.float16, seed=2, mix_slot=1)
    out = fused_add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, (32,), CFG)
    assert torch.equal(out, y0), "dW_1 - dW_1 is exactly zero in one rounding"


def test_bad_inputs_are_named():
    lora_a, lora_b, ranks, scales = make_pool(2, (32,), 32, 16, torch.float16, seed=0)
    x, y, meta = make_batch(4, 32, 32, [0, 1, 0, 1], torch.float16, seed=0)
    with pytest.raises(ValueError, match="split_k must be 1"):
        fused_add_lora(y, x, lora_a, lora_b, meta, ranks, scales, (32,), TileConfig(16, 16, 16, split_k=2))
    with pytest.raises(TypeError, match="x must be float16 or bfloat16"):
        fused_add_lora(y, x.float(), lora_a, lora_b, meta, ranks, scales, (32,), CFG)
    with pytest.raises(ValueError, match="slices"):
        fused_add_lora(y, x, lora_a, lora_b, meta, ranks, scales, (16, 16), CFG)
    with pytest.raises(ValueError, match="x has 3 tokens, y 4"):
        fused_add_lora(y, x[:3], lora_a, lora_b, meta, ranks, scales, (32,), CFG)
    wide_a, wide_b, wide_ranks, wide_scales = make_pool(2, (32,), 32, 144, torch.float16, seed=0)
    with pytest.raises(ValueError, match=r"max_rank \(144\) must be <= 128"):
        fused_add_lora(y, x, wide_a, wide_b, meta, wide_ranks, wide_scales, (32,), CFG)
    with pytest.raises(ValueError, match="one of fused_config, handoff_config or shrink_config"):
        add_lora(y, x, lora_a, lora_b, meta, ranks, scales, (32,), fused_config=CFG, shrink_config=CFG)


# ---- tiling space and heuristic ---------------------------------------------------------------
@pytest.mark.parametrize("tokens, seg, rank", [(1, 1, 16), (16, 1, 64), (64, 64, 128)])
def test_fused_config_space(tokens, seg, rank):
    key = shape_key("fused", tokens, seg, 4096, 4608, rank, 3)
    space = config_space(key, max_smem=100 * 1024)
    assert space and all(c.smem_bytes(rank=key.rank) <= 100 * 1024 for c in space)
    assert all(c.split_k == 1 for c in space), "each program reduces the whole K"
    assert all(c.block_m <= max(16, 2 * key.seg_len) for c in space)
    assert {c.col_tiles for c in space} > {1}, "programs that loop over several column tiles are searched"
    narrow = config_space(shape_key("fused", tokens, seg, 64, 48, rank, 1))
    assert all(c.block_n * c.col_tiles <= max(c.block_n, 64) and c.block_k <= 64 for c in narrow), "no padding"


@pytest.mark.parametrize("tokens, seg, n, slices", [(1, 1, 4096, 1), (1, 1, 4608, 3), (16, 1, 37888, 2),
                                                    (16, 16, 3584, 1), (8, 1, 512, 1)])
def test_heuristic_bounds_the_redundant_shrink(tokens, seg, n, slices):
    key = shape_key("fused", tokens, seg, 4096, n, 16, slices)
    cfg = heuristic_config(key, num_sms=132)
    groups = -(-(n // slices) // (cfg.block_n * cfg.col_tiles))  # column groups of a mean-width slice
    assert cfg.split_k == 1 and 1 <= groups <= MAX_FUSED_GROUPS


# ---- the table's choice: fused only where measured faster ------------------------------------
ONE_TOKEN = shape_key("fused", 1, 1, 4096, 4096, 16, 1)  # the shape the removed heuristic fused


def test_an_empty_table_never_picks_the_fused_kernel():
    """It measured slower than the two launches on an H100 at every decode shape: no guess sends
    a batch to it, however small the batch or short the adapter."""
    empty = TilingTable("GPU")
    for key in (ONE_TOKEN, shape_key("fused", 16, 16, 3584, 4608, 16, 3), shape_key("fused", 64, 1, 4096, 4096, 64, 1)):
        assert empty.one_launch(key) is None
    assert empty.one_launch(_op(ONE_TOKEN, "shrink")) is None, "any op's key names the bucket"


@pytest.mark.parametrize("fused_us, picked", [(7.5, True), (7.7, False), (8.0, False), (9.0, False), (10.9, False)])
def test_the_table_picks_the_fused_kernel_only_where_it_measured_it_faster_than_both_halves(fused_us, picked):
    """Each entry's time is of the whole op: shrink 8.1 us, expand 8.0 us (the expand's tiling at
    its best); fused must beat both by more than the margin (7.7: 4% faster, within it; 9.0:
    faster than the shrink's record, not the expand's)."""
    table = TilingTable("GPU")
    table.record(_op(ONE_TOKEN, "shrink"), CFG, 8.1)
    table.record(_op(ONE_TOKEN, "expand"), CFG, 8.0)
    cfg = TileConfig(16, 64, 128, col_tiles=2)
    table.record(ONE_TOKEN, cfg, fused_us)
    assert table.one_launch(ONE_TOKEN) == (("fused", cfg) if picked else None)


# ---- dispatch ---------------------------------------------------------------------------------
@pytest.fixture
def fused_calls(monkeypatch):
    """The configs add_lora ran the fused kernel with, call by call."""
    calls = []

    def spy(*args):
        calls.append(args[-1])
        return fused_add_lora(*args)

    monkeypatch.setattr(vlora_kernels.lora, "fused_add_lora", spy)
    return calls


def _op(key, op):
    return dataclasses.replace(key, op=op)


def _small(slot_ids, mix=None, max_rank=16):
    lora_a, lora_b, ranks, scales = make_pool(4, (32, 16), 32, max_rank, torch.float16, seed=1)
    x, y, meta = make_batch(len(slot_ids), 32, 48, slot_ids, torch.float16, seed=1, mix_slot=mix)
    return y, x, lora_a, lora_b, meta, ranks, scales, (32, 16)


def test_add_lora_takes_two_launches_where_the_table_measured_no_fused_kernel(fused_calls):
    empty = TilingTable("cpu")
    for slot_ids in ([0], [0, 1, -1, 3, 1], [i % 4 for i in range(16)]):  # 1 to 16 tokens, rank 16
        add_lora(*_small(slot_ids), table=empty)
    add_lora(*_small([0, 1, -2], mix=2), table=empty)  # mixture: always two launches
    assert fused_calls == []
    args = _small([0, 1, -1, 3, 1])
    y0 = args[0].clone()
    out = add_lora(*args, table=empty, fused_config=CFG)  # pinned: the fused kernel, table or not
    assert fused_calls == [CFG]
    assert torch.equal(out, fused_add_lora(y0, *args[1:], CFG))
    add_lora(*_small([0, 1]), table=empty, shrink_config=CFG, expand_config=CFG)  # pinned two launches
    assert len(fused_calls) == 1
    _, x, lora_a, _, meta, *_ = _small([0, 1, -2], mix=2)
    assert one_launch_for(x, lora_a, meta, (32, 16), empty) is None
    _, x, lora_a, _, meta, *_ = _small([0, 1], max_rank=144)
    assert one_launch_for(x, lora_a, meta, (32, 16), empty) is None, "more rank than the kernel holds"


def test_add_lora_follows_the_table_measurement(fused_calls):
    y, x, lora_a, lora_b, meta, ranks, scales, slices = _small([0, 1, 2])
    key = shape_key("fused", 3, 1, 32, 48, 16, 2)
    table = TilingTable("GPU")
    table.record(_op(key, "shrink"), CFG, 6.0)
    table.record(_op(key, "expand"), CFG, 5.0)
    slow = TileConfig(16, 32, 64, col_tiles=4)
    table.record(key, slow, 5.5)  # measured slower than the two launches (faster than the shrink's record)
    assert table.one_launch(key) is None
    add_lora(y, x, lora_a, lora_b, meta, ranks, scales, slices, table=table)
    assert fused_calls == []
    table.record(key, slow, 4.0)
    add_lora(y, x, lora_a, lora_b, meta, ranks, scales, slices, table=table)
    assert fused_calls == [slow]
    wider = shape_key("fused", 3, 1, 64, 96, 16, 2)  # unmeasured model size: the nearest measured shape decides
    assert table.one_launch(wider) == ("fused", slow)
    alone = TilingTable("GPU")
    alone.record(key, slow, 4.0)
    assert alone.one_launch(key) is None, "no two-launch time recorded at that shape: no comparison, two launches"


def test_tables_written_before_the_fused_op_still_load():
    entry = {"block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4, "num_warps": 4, "num_stages": 3, "us": 7.1}
    assert TileConfig.from_dict(entry) == TileConfig(16, 64, 128, 4, 4, 3, col_tiles=1)
    with pytest.raises(ValueError, match=r"lacks \['block_m'\]"):
        TileConfig.from_dict({"block_n": 64, "block_k": 128})
    with pytest.raises(ValueError, match="col_tiles=3"):
        TileConfig(16, 16, 16, col_tiles=3)
    h200 = TilingTable.for_device("NVIDIA H200")
    assert h200.entries and not any(k.startswith("fused") for k in h200.entries)
    assert h200.lookup(shape_key("shrink", 1, 1, 4096, 4096, 64, 1)).col_tiles == 1
    # no fused measurement on that GPU yet: two launches everywhere
    assert h200.one_launch(ONE_TOKEN) is None
    assert h200.one_launch(shape_key("fused", 1, 1, 4096, 4096, 64, 1)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_real_shapes_on_the_gpu(tokens):
    """Full-size fused q/k/v at the heuristic's tiling."""
    slot_ids, slices = token_slots(tokens, "skewed"), (3584, 512, 512)
    cfg = heuristic_config(shape_key("fused", tokens, tokens, 3584, 4608, 64, 3))
    _check(*_run(slot_ids, slices, 3584, 64, 64, torch.bfloat16, seed=tokens, config=cfg, rank_choices=[8, 16, 64]),
           slot_ids, torch.bfloat16)
