"""The one-launch handoff ATMM kernel (`vlora_kernels/handoff.py`) against the fp32 reference (CPU:
through the Triton interpreter; on a GPU compiled, where its shrink and expand programs run side
by side and the in-launch wait is real)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from lora_cases import make_batch, make_pool, rel_err
from test_fused import _check, _junk_past_ranks, _slots, _small

import vlora_kernels.lora
from vlora_kernels import handoff
from vlora_kernels.handoff import counters, handoff_add_lora, handoff_grid
from vlora_kernels.lora import add_lora, one_launch_for
from vlora_kernels.reference import lora_reference
from vlora_kernels.search import SearchJob, search_keys
from vlora_kernels.table import TilingTable
from vlora_kernels.tiling import TileConfig, config_space, handoff_space, heuristic_config, next_pow2, shape_key

# Small tiles, so the little test shapes take several K steps per split, several column groups
# per slice and a last group shorter than col_tiles.
CFG = TileConfig(16, 16, 16, split_k=2, col_tiles=2)


def _run(slot_ids, slices, k, max_rank, n_slots, dtype, seed, config=CFG, junk=False, tickets=True, **pool_kw):
    """(y before, the fp32 reference, the kernel's y): y starts random, never zero."""
    lora_a, lora_b, ranks, scales = make_pool(n_slots, slices, k, max_rank, dtype, seed, **pool_kw)
    x, y0, meta = make_batch(len(slot_ids), k, sum(slices), slot_ids, dtype, seed)
    ref = lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)  # reads ranks' rows only
    if junk:
        _junk_past_ranks(lora_a, lora_b, ranks, slices, seed)
    y = y0.clone()
    out = handoff_add_lora(y, x, lora_a, lora_b, meta, ranks, scales, slices, config, tickets=tickets)
    assert out is y, "y is updated in place and returned"
    assert not counters(x.device).any(), "the launch leaves its counters at zero for the next"
    return y0, ref, out


@pytest.mark.parametrize("tickets", [True, None], ids=["tickets", "default"])
@pytest.mark.parametrize("tokens", [1, 3, 16, 33])
@pytest.mark.parametrize("mix", ["one", "distinct", "skewed", "no_lora_interleaved"])
def test_matches_reference_over_token_counts_and_adapter_mixes(tokens, mix, tickets):
    slot_ids = _slots(mix, tokens)
    dtype = torch.bfloat16 if tokens % 2 else torch.float16
    _check(*_run(slot_ids, (48,), 64, 16, 40, dtype, seed=tokens, tickets=tickets), slot_ids, dtype)


@pytest.mark.parametrize("mix", ["distinct", "no_lora_interleaved"])
def test_roles_by_program_id_match_the_reference_too(mix):
    slot_ids = _slots(mix, 13)
    out = _run(slot_ids, (48, 16), 40, 32, 40, torch.float16, seed=13, tickets=False, untargeted=0.2)
    _check(*out, slot_ids, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k, slices", [(33, (48, 16, 16)), (40, (40, 24)), (64, (16,))])
@pytest.mark.parametrize("config", [CFG, TileConfig(16, 32, 16, split_k=4, col_tiles=1),
                                    TileConfig(32, 16, 32, split_k=1, col_tiles=4, num_warps=8)],
                         ids=["split2_cols2", "split4_cols1", "split1_cols4"])
def test_slices_odd_k_untargeted_slices_and_splits(dtype, k, slices, config):
    """Odd K ends a split part way through a K step (and, with 4 splits of K 33, leaves a split
    with no K at all); a 40-wide slice ends a column group part way."""
    slot_ids = [2, 0, -1, 2, 1, 3, -1, 0, 2, 2, 2]
    _check(*_run(slot_ids, slices, k, 32, 4, dtype, seed=k, config=config, untargeted=0.3), slot_ids, dtype)


def test_ranks_1_to_128_in_one_batch_ignore_junk_past_each_rank():
    ranks = [1, 7, 8, 16, 33, 64, 100, 128]
    slot_ids = [i % len(ranks) if i % 5 != 4 else -1 for i in range(20)]
    out = _run(slot_ids, (32, 16), 40, 128, len(ranks), torch.bfloat16, seed=3, rank_choices=ranks, junk=True,
               config=TileConfig(16, 16, 16, split_k=2, col_tiles=1))
    _check(*out, slot_ids, torch.bfloat16)


def test_launches_in_a_row_each_start_from_zeroed_counters():
    """The second launch (another batch, another grid) is right only if the first reset the
    counters: with tickets left over, its programs would take the wrong roles."""
    lora_a, lora_b, ranks, scales = make_pool(4, (32,), 48, 16, torch.float16, seed=7)
    for tokens, slot_ids in ((5, [0, 1, 1, 3, 0]), (9, [2] * 9), (3, [3, -1, 1])):
        x, y0, meta = make_batch(tokens, 48, 32, slot_ids, torch.float16, seed=tokens)
        ref = lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, (32,))
        out = handoff_add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, (32,), CFG, tickets=True)
        _check(y0, ref, out, slot_ids, torch.float16)
        assert not counters(x.device).any()


def test_padded_graph_metadata_and_empty_batches():
    slot_ids, slices = [2, 0, 2, -1, 1], (32,)
    lora_a, lora_b, ranks, scales = make_pool(4, slices, 32, 16, torch.float16, seed=5)
    x, y0, meta = make_batch(5, 32, 32, slot_ids, torch.float16, seed=5)
    _, _, padded = make_batch(5, 32, 32, slot_ids, torch.float16, seed=5, max_segments=4, max_tokens=8)
    a = handoff_add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices, CFG)
    b = handoff_add_lora(y0.clone(), x, lora_a, lora_b, padded, ranks, scales, slices, CFG)
    assert torch.equal(a, b), "padding segments and tiles add nothing"
    _, _, none = make_batch(5, 32, 32, [-1] * 5, torch.float16, seed=5)
    assert torch.equal(handoff_add_lora(y0.clone(), x, lora_a, lora_b, none, ranks, scales, slices, CFG), y0)
    assert not counters(x.device).any()


def test_a_batch_whose_adapters_leave_every_slice_untargeted_changes_nothing():
    """No expand item has work, so none waits; the launch still ends with its counters at zero."""
    lora_a, lora_b, ranks, scales = make_pool(3, (32, 16), 32, 16, torch.float16, seed=4)
    ranks.zero_()
    x, y0, meta = make_batch(4, 32, 48, [0, 1, 2, 1], torch.float16, seed=4)
    out = handoff_add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, (32, 16), CFG)
    assert torch.equal(out, y0)
    assert not counters(x.device).any()


def test_a_given_workspace_is_used_and_checked():
    slot_ids, slices = [1, 0, 1], (32, 16)
    lora_a, lora_b, ranks, scales = make_pool(2, slices, 32, 16, torch.float16, seed=9)
    x, y0, meta = make_batch(3, 32, 48, slot_ids, torch.float16, seed=9)
    v = torch.full((2, 2, 3, 16), float("nan"), device=x.device)  # every cell read is written first
    out = handoff_add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices, CFG, v=v)
    _check(y0, lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices), out, slot_ids,
           torch.float16)
    with pytest.raises(ValueError, match=r"v must be float32 \(2, 2, 3, 16\)"):
        handoff_add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices, CFG, v=v[:1])


def test_grid_counts_and_group_width():
    _, _, meta = make_batch(10, 32, 32, [0] * 6 + [1] * 4, torch.float16, seed=0)  # 2 segments of <= 6
    n_shrink, n_expand, k_per_split, col_tiles, groups = handoff_grid(
        meta, 3, 100, 200, TileConfig(16, 16, 32, split_k=4, col_tiles=16))
    assert (n_shrink, k_per_split) == (2 * 1 * 3 * 4, 64)  # segments x token tiles x slices x splits
    assert col_tiles == 8 and groups == 1, "a group is never wider than the widest slice (100 -> 7 tiles of 16)"
    assert n_expand == 2 * 3 * groups


def test_bad_inputs_are_named():
    lora_a, lora_b, ranks, scales = make_pool(2, (32,), 32, 16, torch.float16, seed=0)
    x, y, meta = make_batch(4, 32, 32, [0, 1, 0, 1], torch.float16, seed=0)
    _, _, mixture = make_batch(4, 32, 32, [0, 1, 0, 1], torch.float16, seed=0, mix_slot=1)
    with pytest.raises(ValueError, match="mixture batch goes to add_lora's two launches"):
        handoff_add_lora(y, x, lora_a, lora_b, mixture, ranks, scales, (32,), CFG)
    with pytest.raises(TypeError, match="x must be float16 or bfloat16"):
        handoff_add_lora(y, x.float(), lora_a, lora_b, meta, ranks, scales, (32,), CFG)
    with pytest.raises(ValueError, match="x has 3 tokens, y 4"):
        handoff_add_lora(y, x[:3], lora_a, lora_b, meta, ranks, scales, (32,), CFG)
    wide_a, wide_b, wide_ranks, wide_scales = make_pool(2, (32,), 32, 144, torch.float16, seed=0)
    with pytest.raises(ValueError, match=r"max_rank \(144\) must be <= 128"):
        handoff_add_lora(y, x, wide_a, wide_b, meta, wide_ranks, wide_scales, (32,), CFG)
    big_x, big_y, big = make_batch(65, 32, 32, [0] * 65, torch.float16, seed=0)
    with pytest.raises(ValueError, match="<= 64 tokens, got 65"):
        handoff_add_lora(big_y, big_x, lora_a, lora_b, big, ranks, scales, (32,), CFG)
    assert not counters(x.device).any(), "refused before any launch"


def test_reset_counters_recovers_from_a_launch_that_died(monkeypatch):
    lora_a, lora_b, ranks, scales = make_pool(2, (32,), 32, 16, torch.float16, seed=1)
    x, y0, meta = make_batch(4, 32, 32, [0, 1, 0, 1], torch.float16, seed=1)
    counters(x.device)[:, 0] = 7  # as a launch stopped part way would leave them
    handoff.reset_counters()
    out = handoff_add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, (32,), CFG)
    _check(y0, lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, (32,)), out, [0, 1, 0, 1],
           torch.float16)


def test_no_cache_entry_is_created_inside_graph_capture(monkeypatch):
    """Made during capture, the counters' memory would belong to the graph's private pool."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="run one launch on the capturing stream before capture"):
        handoff._created(cuda, "counters", lambda: pytest.fail("nothing is made during capture"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert handoff._created(cuda, "counters", lambda: "made") == "made"


# ---- roles by program id where the grid fits; the table's choice and add_lora's dispatch --------
def test_roles_by_id_only_where_every_program_fits_on_the_gpu_at_once():
    assert handoff.roles_by_id(132, 132) and handoff.roles_by_id(264, 132, per_sm=2)
    assert not handoff.roles_by_id(133, 132) and not handoff.roles_by_id(265, 132, per_sm=2)


def test_programs_per_sm_are_bounded_by_registers_shared_memory_and_threads():
    sm = handoff.H100_SM
    r16 = TileConfig(16, 128, 256, split_k=16, num_warps=4, num_stages=2)
    assert handoff.resident_per_sm(r16, 16, sm) == 2, "4 warps at 255 registers a thread: 2 per SM"
    assert handoff.resident_per_sm(replace(r16, num_warps=8), 16, sm) == 1
    # rank 128, 64-token tiles: ~260 KiB of bound, more than an SM has: still 1 (it launched, so it fits)
    assert handoff.smem_bound(TileConfig(64, 128, 256, num_stages=2), 128) > sm["shared_memory_per_multiprocessor"]
    assert handoff.resident_per_sm(TileConfig(64, 128, 256, num_stages=2), 128, sm) == 1
    assert handoff.resident_per_sm(r16, 16, dict(sm, shared_memory_per_multiprocessor=48 * 1024)) == 1
    assert handoff.resident_per_sm(r16, 16, dict(sm, max_threads_per_multi_processor=128)) == 1
    assert handoff.resident_per_sm(r16, 16, dict(sm, regs_per_multiprocessor=0)) == 1, "unknown: one per SM"


def test_the_default_form_follows_the_grid_size(monkeypatch):
    """By program id on a grid that fits on the GPU at once, tickets on a larger one; both right."""
    seen = []
    real = handoff.roles_by_id
    monkeypatch.setattr(handoff, "roles_by_id", lambda n, sms, per_sm: seen.append((n, sms, per_sm, real(n, sms, per_sm)))
                        or real(n, sms, per_sm))
    slot_ids = _slots("distinct", 9)
    _check(*_run(slot_ids, (48,), 64, 16, 40, torch.float16, seed=2, tickets=None), slot_ids, torch.float16)
    monkeypatch.setattr(handoff, "_sm", lambda device: dict(handoff.H100_SM, multi_processor_count=4))
    _check(*_run(slot_ids, (48,), 64, 16, 40, torch.float16, seed=2, tickets=None), slot_ids, torch.float16)
    n = sum(handoff_grid(make_batch(9, 64, 48, slot_ids, torch.float16, seed=2)[2], 1, 48, 64, CFG)[:2])
    assert n > 8, "the small GPU cannot hold the grid at 2 programs per SM"
    assert seen == [(n, 132, 2, True), (n, 4, 2, False)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rank", [16, 64])
def test_compiled_programs_stay_within_the_shared_memory_bound(monkeypatch, rank):
    """roles_by_id's safety rests on smem_bound being an upper bound: check it on every tiling
    the search tries, as Triton compiled them here."""
    compiled = []
    real = handoff._launch
    monkeypatch.setattr(handoff, "_launch", lambda *a, **k: compiled.append((a[0], real(*a, **k))) or compiled[-1][1])
    slot_ids = _slots("skewed", 32)
    lora_a, lora_b, ranks, scales = make_pool(40, (4096,), 4096, rank, torch.float16, seed=0)
    x, y, meta = make_batch(32, 4096, 4096, slot_ids, torch.float16, seed=0)
    for cfg in handoff_space(32, meta.num_segments, meta.max_seg_len, 4096, 4096, 1):
        handoff_add_lora(y.clone(), x, lora_a, lora_b, meta, ranks, scales, (4096,), cfg, tickets=False)
        kernel = compiled[-1][1]
        assert kernel.metadata.shared <= handoff.smem_bound(cfg, max(16, rank)), (cfg, kernel.metadata.shared)
        assert kernel.metadata.num_warps == cfg.num_warps


KEY = shape_key("handoff", 3, 1, 32, 48, 16, 2)  # the bucket of test_fused's _small([0, 1, 2])


def _table(handoff_us, two_launch_us=None, fused_us=None):
    table = TilingTable("GPU")
    for op in ("shrink", "expand"):
        table.record(replace(KEY, op=op), CFG, 6.0)
    table.record(KEY, CFG, handoff_us, two_launch_us=two_launch_us)
    if fused_us is not None:
        table.record(replace(KEY, op="fused"), TileConfig(16, 16, 32), fused_us)
    return table


@pytest.mark.parametrize("handoff_us, two_launch_us, fused_us, picked", [
    (5.0, None, None, "handoff"),   # faster than the halves' records by more than the margin
    (5.8, None, None, None),        # 3% faster: within the margin
    (5.0, 5.1, None, None),         # the two launches timed in the same run decide, not the halves' records
    (6.5, 7.0, None, "handoff"),    # ... either way
    (5.0, None, 4.5, "fused"),      # both one-launch ops beat two launches: the faster one
    (4.5, None, 5.0, "handoff"),
])
def test_the_table_picks_the_fastest_one_launch_op_that_beat_two_launches(handoff_us, two_launch_us, fused_us, picked):
    choice = _table(handoff_us, two_launch_us, fused_us).one_launch(KEY)
    assert (choice[0] if choice else None) == picked
    assert _table(handoff_us, two_launch_us).entries[str(KEY)].get("two_launch_us") == two_launch_us


def test_add_lora_runs_the_handoff_kernel_where_the_table_picks_it(monkeypatch):
    calls = []
    real = vlora_kernels.lora.handoff_add_lora
    monkeypatch.setattr(vlora_kernels.lora, "handoff_add_lora", lambda *a: calls.append(a[-1]) or real(*a))
    y, x, lora_a, lora_b, meta, ranks, scales, slices = _small([0, 1, 2])
    ref = lora_reference(y.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    out = add_lora(y.clone(), x, lora_a, lora_b, meta, ranks, scales, slices, table=_table(5.8))
    assert calls == [], "not measured faster by the margin: two launches"
    out = add_lora(y.clone(), x, lora_a, lora_b, meta, ranks, scales, slices, table=_table(5.0))
    assert calls == [CFG]
    _check(y, ref, out, [0, 1, 2], torch.float16)
    assert one_launch_for(x, lora_a, meta, slices, _table(5.0)) == ("handoff", CFG)
    mixed = _small([0, 1, -2], mix=2)[4]
    assert one_launch_for(x, lora_a, mixed, slices, _table(5.0)) is None, "mixtures keep the two launches"
    _, x65, a65, _, meta65, *_ = _small([i % 4 for i in range(65)])
    assert one_launch_for(x65, a65, meta65, slices, _table(5.0)) is None, "past decode sizes: two launches"


def test_the_search_covers_the_handoff_op_at_decode_sizes_only():
    job = SearchJob([1, 64, 256], ["distinct"], [16, 256], [3584], layouts=[(3584, (3584, 512, 512))], ops=["handoff"])
    keys = search_keys(job)
    assert keys and all(k.op == "handoff" and k.tokens <= 64 and k.rank <= 128 for k in keys)
    for key in keys:
        space = config_space(key)
        assert space and space[0] == heuristic_config(key)
        for c in space:
            assert c.split_k & (c.split_k - 1) == 0 and c.split_k * c.block_k <= key.k, "every split gets K"
            assert c.block_n * c.col_tiles <= max(64, next_pow2(-(-key.n // key.slices)))
