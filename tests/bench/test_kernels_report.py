"""The benchmark's target checks and the search's shape buckets (no GPU needed)."""

from __future__ import annotations

import pytest

from bench.kernels_report import summarize
from vlora_kernels.search import SearchJob, pending_keys, search_keys
from vlora_kernels.table import TilingTable
from vlora_kernels.tiling import TileConfig


def _row(tokens, impl, us, floor):
    return dict(device="GPU", date="d", tokens=tokens, mix="distinct", rank=64, hidden=4096, impl=impl,
                us=us, floor_us=floor, x_floor=round(us / floor, 3))


def test_summary_applies_the_issue_targets():
    rows = [
        _row(64, "atmm", 20.0, 16.0), _row(64, "atmm_static", 30.0, 16.0), _row(64, "einsum", 90.0, 16.0),
        _row(1, "atmm", 12.0, 0.3), _row(1, "atmm_static", 12.0, 0.3), _row(1, "loop", 20.0, 0.3),
        _row(4096, "atmm", 70.0, 40.0), _row(4096, "atmm_static", 70.0, 40.0), _row(4096, "loop", 900.0, 40.0),
    ]
    merge = [{"op": "merge_all", "model": "m", "modules": "all", "rank": 16, "impl": "atmm_merge", "us": 7.0,
              "floor_us": 6.0, "x_floor": 1.17}]
    s = summarize(rows, merge, dict(device="GPU", date="d"))
    assert s["decode_shapes"] == 2 and s["decode_ok"] == 1, "12 us > max(10, 1.5 x 0.3) fails; 20 <= 24 passes"
    assert s["prefill_shapes"] == 1 and s["prefill_ok"] == 0, "70 / 40 = 1.75x floor"
    assert (s["decode_target_ok"], s["prefill_target_ok"]) == (1, 0), "20 <= 1.3 x 16; 12 > 8; 1.75x > 1.3x"
    assert s["pdl_geomean"] is None, "no run without programmatic dependent launch"
    assert s["table_vs_static_geomean"] == pytest.approx((1.5 * 1 * 1) ** (1 / 3), abs=1e-3)
    assert s["table_vs_static_min"] == 1.0
    assert s["merge"][0]["x_floor"] == 1.17
    assert s["min_vs_sgmv"] is None  # not timed in these rows
    rows += [_row(64, "sgmv", 30.0, 16.0), _row(4096, "sgmv", 140.0, 40.0), _row(4096, "mbgmv", 700.0, 40.0)]
    s = summarize(rows, merge, dict(device="GPU", date="d"))
    assert s["min_vs_sgmv"] == 1.5 and s["min_vs_mbgmv"] == 10.0  # 30/20 at 64 tokens; 700/70 at 4096
    assert s["decode"][0]["vs_sgmv"] == 1.5 and "vs_mbgmv" not in s["decode"][0]


def test_search_buckets_each_shape_once_per_op():
    keys = search_keys(SearchJob([1, 64, 256], ["distinct", "identical"], [16], [4096]))
    # t=1: both mixes are one token (one bucket); t=64: seg 1 (distinct) and 64 (identical); t=256: 64 requests
    # of 4 tokens (distinct) and one of 256
    buckets = [(1, 1), (64, 1), (64, 64), (256, 4), (256, 256)]
    assert sorted(str(k) for k in keys) == sorted(
        [f"{op}|t{t}|m{m}|k4096|n4096|r16|s1" for op in ("shrink", "expand") for t, m in buckets]
        + [f"{op}|t{t}|m{m}|k4096|n4096|r16|s1" for op in ("fused", "handoff") for t, m in buckets
           if t <= 64])  # the one-launch ops: decode only
    ops = [k.op for k in keys if (k.tokens, k.seg_len) == (64, 1)]
    assert ops == ["shrink", "expand", "fused", "handoff"], "one-launch ops are timed after both halves"


def test_summary_sets_the_fused_kernel_beside_the_two_launches():
    rows = [_row(1, "atmm", 6.0, 0.3), _row(1, "atmm_fused", 3.0, 0.3), _row(64, "atmm", 20.0, 16.0),
            _row(64, "atmm_fused", 25.0, 16.0), _row(4096, "atmm", 70.0, 40.0)]
    s = summarize(rows, [], dict(device="GPU", date="d"))
    assert (s["fused_shapes"], s["fused_faster"]) == (2, 1)
    assert [e.get("fused_speedup") for e in s["decode"]] == [2.0, 0.8]
    assert "fused_us" not in s["prefill"][0]
    assert summarize(rows[2:3], [], dict(device="GPU", date="d"))["fused_shapes"] == 0


def test_bench_times_the_fused_kernel_at_decode_sizes_only():
    import dataclasses

    from bench.kernels import one_launch_impl
    from vlora_kernels.lora import add_lora
    from vlora_kernels.table import TilingTable
    from vlora_kernels.tiling import TileConfig, heuristic_config, shape_key
    from vlora_kernels.workload import LoRAShape

    table = TilingTable("GPU")
    key = shape_key("fused", 8, 1, 4096, 4096, 64, 1)
    impl = one_launch_impl(LoRAShape(8, "distinct", 64, 4096, (4096,)), table, "fused")
    assert impl.func is add_lora and impl.keywords["fused_config"] == heuristic_config(key)
    handoff = one_launch_impl(LoRAShape(8, "distinct", 64, 4096, (4096,)), table, "handoff")
    assert handoff.keywords["handoff_config"] == heuristic_config(dataclasses.replace(key, op="handoff"))
    assert table.one_launch(key) is None, "timed although add_lora would not pick it"
    assert one_launch_impl(LoRAShape(256, "distinct", 64, 4096, (4096,)), table, "fused") is None
    assert one_launch_impl(LoRAShape(8, "distinct", 256, 4096, (4096,)), table, "handoff") is None
    # a table entry measured slower than the two launches: add_lora keeps them, the bench still times its tiling
    slow = TileConfig(16, 32, 64, col_tiles=4)
    for op, cfg, us in (("shrink", heuristic_config(key), 20.0), ("expand", heuristic_config(key), 20.0),
                        ("fused", slow, 30.0)):
        table.record(dataclasses.replace(key, op=op), cfg, us)
    assert table.one_launch(key) is None
    assert one_launch_impl(LoRAShape(8, "distinct", 64, 4096, (4096,)), table, "fused").keywords["fused_config"] == slow


def test_search_covers_the_zoo_models_projection_layouts():
    from vlora.commands.tune import projection_layouts

    layouts = projection_layouts("qwen2_vl_7b")
    assert layouts == [(3584, (3584, 512, 512)), (3584, (3584,)), (3584, (18944, 18944)), (18944, (3584,))]
    keys = search_keys(SearchJob([64], ["distinct"], [8], [], layouts=layouts))
    assert {(k.k, k.n, k.slices) for k in keys} == {(3584, 4608, 3), (3584, 3584, 1), (3584, 37888, 2),
                                                    (18944, 3584, 1)}
    assert {k.rank for k in keys} == {16}, "rank 8 shares the 16-wide bucket"


def test_summary_reads_the_pdl_speedup_and_skips_a_missing_pytorch_condition():
    rows = [_row(1, "atmm", 5.0, 0.3), _row(1, "atmm_nopdl", 6.0, 0.3), _row(8, "atmm", 9.0, 2.0),
            _row(8, "atmm_nopdl", 9.9, 2.0), _row(64, "atmm", 20.0, 16.0)]
    s = summarize(rows, [], dict(device="GPU", date="d"))
    assert [e.get("pdl_speedup") for e in s["decode"]] == [1.2, 1.1, None]
    assert s["pdl_geomean"] == pytest.approx((1.2 * 1.1) ** 0.5, abs=1e-3) and s["pdl_range"] == [1.1, 1.2]
    # no PyTorch baseline ran: the bound alone decides (5 and 9 us <= 10; 20 <= 1.5 x 16)
    assert s["decode_ok"] == 3 and s["decode_target_ok"] == 2, "9 us > max(8, 1.3 x 2)"
    assert s["decode_min_vs_torch"] is None and s["decode"][0]["vs_torch"] is None
    assert s["mix_keyed_geomean"] is None
    rows += [_row(8, "atmm_anymix", 13.5, 2.0)]
    s = summarize(rows, [], dict(device="GPU", date="d"))
    assert s["decode"][1]["mix_keyed_speedup"] == 1.5 and s["mix_keyed_geomean"] == 1.5
    assert s["flat_grid_geomean"] is None and s["flat_grid_shapes"] == 0
    rows += [_row(4096, "atmm", 50.0, 40.0), _row(4096, "atmm_grid2d", 60.0, 40.0)]
    s = summarize(rows, [], dict(device="GPU", date="d"))
    assert s["prefill"][0]["flat_grid_speedup"] == 1.2 and s["flat_grid_shapes"] == 1
    assert s["flat_grid_geomean"] == 1.2 and s["flat_grid_range"] == [1.2, 1.2]


def test_search_ops_can_leave_out_the_fused_kernel():
    keys = search_keys(SearchJob([8], ["distinct"], [16], [4096], ops=["shrink", "expand"]))
    assert sorted(k.op for k in keys) == ["expand", "shrink"]
    for bad in (["shrink"], ["fused", "expand"], ["gemm"]):
        with pytest.raises(ValueError, match="tune.ops"):
            search_keys(SearchJob([8], ["distinct"], [16], [4096], ops=bad))


def test_redo_searches_again_only_the_named_ops_buckets():
    job = SearchJob([1024], ["identical"], [64], [4096], ops=["shrink", "expand"])
    table = TilingTable("GPU", num_sms=132)
    for key in search_keys(job):
        table.record(key, TileConfig(16, 64, 64), 10.0)
    assert pending_keys(job, table) == {}, "a resumed run skips what the table has"
    job.redo = ["expand"]
    assert [k.op for k in pending_keys(job, table)] == ["expand"]
    job.redo = ["fused"]
    with pytest.raises(ValueError, match="tune.redo"):
        pending_keys(job, table)


def test_compile_work_keeps_each_tiling_in_one_worker():
    from vlora_kernels.search import compile_chunks
    from vlora_kernels.tiling import TileConfig
    from vlora_kernels.workload import LoRAShape

    cfgs = [TileConfig(16, 16 << i, 64) for i in range(5)]
    shapes = [LoRAShape(16, "distinct", r, k, sl) for r in (16, 64) for k, sl in ((4096, (4096,)), (3584, (3584, 512, 512)))]
    work = [(op, c, s) for op in ("shrink", "expand") for c in cfgs for s in shapes]
    chunks = compile_chunks(work, 3)
    assert sorted(map(id, (i for c in chunks for i in c))) == sorted(map(id, work)), "every item once"
    owner = {}
    for n, chunk in enumerate(chunks):
        for op, cfg, _ in chunk:
            assert owner.setdefault((op, cfg), n) == n, "one (op, tiling) split across workers"
        layouts = [(s.rank, s.k, s.slices) for _, _, s in chunk]
        assert layouts == sorted(layouts)
    assert len(chunks) == 3 and compile_chunks(work, 1) == [sorted(work, key=lambda i: (i[2].rank, i[2].k, i[2].slices))]


def test_compile_batches_follow_the_search_order_and_compile_each_kernel_once():
    from vlora_kernels.search import compile_batches
    from vlora_kernels.tiling import config_space

    keys = search_keys(SearchJob([8, 64], ["distinct"], [16], [4096], layouts=[(3584, (3584, 512, 512))]))
    spaces = {k: config_space(k, 227 * 1024) for k in keys}
    batches = compile_batches(keys, spaces, 4)
    assert [k for part, _ in batches for k in part] == list(keys), "timed in the search order"
    assert [len(part) for part, _ in batches] == [4, 4, 4, 4]
    idents = [(op, cfg, s.rank, s.k, s.slices) for _, work in batches for op, cfg, s in work]
    assert len(idents) == len(set(idents)), "nothing compiled twice"
    for part, work in batches:  # each batch compiles what its own keys time, unless an earlier one did
        needed = {(k.op, cfg, keys[k].rank, keys[k].k, keys[k].slices) for k in part for cfg in spaces[k]}
        assert {(op, cfg, s.rank, s.k, s.slices) for op, cfg, s in work} <= needed
    assert set(idents) == {(k.op, cfg, s.rank, s.k, s.slices) for k, s in keys.items() for cfg in spaces[k]}
    assert len(compile_batches(keys, spaces, 0)) == 1
