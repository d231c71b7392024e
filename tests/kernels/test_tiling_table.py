"""Tiling space, table lookup with its fallbacks, segment metadata and benchmark workloads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vlora_kernels.segments import build_segments
from vlora_kernels.table import TilingTable, device_slug
from vlora_kernels.tiling import ShapeKey, TileConfig, config_space, heuristic_config, shape_key
from vlora_kernels.workload import MIXES, LoRAShape, floor_cost, token_slots


def test_tile_configs_are_powers_of_two_at_least_16():
    with pytest.raises(ValueError, match="block_m=8"):
        TileConfig(8, 16, 16)
    with pytest.raises(ValueError, match="block_k=48"):
        TileConfig(16, 16, 48)
    with pytest.raises(ValueError, match="split_k=3"):
        TileConfig(16, 16, 16, split_k=3)


@pytest.mark.parametrize("op", ["shrink", "expand"])
@pytest.mark.parametrize("tokens, seg", [(1, 1), (64, 1), (64, 64), (8192, 128)])
def test_config_space_respects_shared_memory_and_shape(op, tokens, seg):
    key = shape_key(op, tokens, seg, 4096, 4096, 64, 1)
    space = config_space(key, max_smem=100 * 1024)
    assert space and all(c.smem_bytes() <= 100 * 1024 for c in space)
    assert all(c.block_m <= max(16, 2 * key.seg_len) for c in space), "no tile of pure padding rows"
    if op == "shrink":
        assert all(c.block_n == 64 for c in space), "the whole rank in one tile: x is read once"
        assert all(c.split_k * c.block_k <= 4096 for c in space)
    else:
        assert all(c.split_k == 1 for c in space)
    assert len(config_space(key, max_smem=227 * 1024)) >= len(space)


def test_shape_key_buckets_and_round_trips():
    key = shape_key("shrink", 100, 3, 3584, 4608, 48, 3)
    assert (key.tokens, key.seg_len, key.rank) == (128, 4, 64)
    assert ShapeKey.parse(str(key)) == key
    with pytest.raises(ValueError, match="op 'gemm'"):
        shape_key("gemm", 1, 1, 16, 16, 16, 1)


def test_heuristic_splits_k_only_when_the_grid_is_small():
    decode = heuristic_config(shape_key("shrink", 64, 1, 4096, 4096, 64, 1))
    prefill = heuristic_config(shape_key("shrink", 8192, 8192, 4096, 4096, 64, 1))
    assert decode.split_k >= 4 and prefill.split_k <= 2
    assert decode.block_n == 64 and prefill.block_m == 64


def test_table_lookup_exact_nearest_and_fallback(tmp_path):
    table = TilingTable("NVIDIA H100 80GB HBM3", num_sms=132)
    exact = shape_key("shrink", 64, 1, 4096, 4096, 64, 1)
    cfg = TileConfig(16, 64, 256, 8, 4, 3)
    table.record(exact, cfg, 12.5)
    table.save(tmp_path / "t.json")
    loaded = TilingTable.load(tmp_path / "t.json")
    assert loaded.lookup(exact) == cfg
    assert json.loads((tmp_path / "t.json").read_text())["entries"][str(exact)]["us"] == 12.5
    near = shape_key("shrink", 64, 1, 3584, 3584, 64, 1)  # same buckets, other model width
    assert loaded.lookup(near) == cfg
    unknown = shape_key("expand", 64, 1, 4096, 4096, 64, 1)
    assert loaded.lookup(unknown) == heuristic_config(unknown, 132)
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert TilingTable.for_device("Imaginary GPU 9000", table_dir=tmp_path).entries == {}


def test_segments_group_tokens_by_slot_and_skip_no_lora():
    meta = build_segments([2, -1, 0, 2, 1, 0, -1, 2])
    assert meta.host_segments == ((0, 0, 2), (1, 2, 1), (2, 3, 3))
    assert meta.token_order.tolist() == [2, 5, 4, 0, 3, 7], "stable: batch order kept within a slot"
    assert (meta.num_tokens, meta.num_segments, meta.max_seg_len, meta.slots) == (8, 3, 3, (0, 1, 2))
    empty = build_segments([-1, -1])
    assert empty.num_segments == 0 and empty.max_seg_len == 0
    padded = build_segments([1, 1, 0], max_segments=4, max_tokens=8)
    assert padded.seg_len.tolist() == [1, 2, 0, 0] and padded.max_seg_len == 8
    with pytest.raises(ValueError, match="max_segments=1"):
        build_segments([0, 1], max_segments=1)
    with pytest.raises(ValueError, match=">= -1"):
        build_segments([0, -2])
    with pytest.raises(ValueError, match="1-D"):
        build_segments(np.zeros((2, 2)))


def test_workload_mixes():
    assert len(set(token_slots(64, "distinct"))) == 64
    assert len(set(token_slots(64, "uniform"))) == 8
    assert set(token_slots(256, "identical")) == {0}
    skewed = token_slots(64, "skewed")
    counts = np.bincount(skewed)
    assert counts.max() > 64 / 8 and len(set(skewed)) < 64, "a few hot adapters and a tail"
    assert token_slots(64, "skewed") == skewed, "seeded"
    assert len(token_slots(1000, "distinct")) == 1000
    with pytest.raises(ValueError, match="mix 'zipf'"):
        token_slots(8, "zipf")
    assert set(MIXES) == {"distinct", "uniform", "skewed", "identical"}


def test_floor_counts_each_distinct_adapter_once():
    one = floor_cost(LoRAShape(64, "identical", 64, 4096, (4096,)))[1]
    many = floor_cost(LoRAShape(64, "distinct", 64, 4096, (4096,)))[1]
    assert many - one == pytest.approx(63 * 64 * (4096 + 4096) * 2)


def test_shrink_split_space_follows_the_grid():
    """Deep K splits at decode sizes, up to 8 at 1024 tokens (a segment of 16-row tiles is
    fewer programs than the SMs), at most 2 once token tiles fill the GPU."""
    def splits(tokens):
        return {c.split_k for c in config_space(shape_key("shrink", tokens, tokens, 4096, 4096, 16, 1))}
    assert splits(64) == {1, 2, 4, 8, 16} and splits(1024) == {1, 2, 4, 8} and splits(8192) == {1, 2}


def test_expand_column_groups_only_at_prefill_and_within_the_slice():
    decode = config_space(shape_key("expand", 64, 64, 4096, 4096, 64, 1))
    prefill = config_space(shape_key("expand", 1024, 1024, 4096, 4096, 64, 1))
    narrow = config_space(shape_key("expand", 1024, 1024, 4096, 3 * 128, 16, 3))  # three 128-wide slices
    assert all(c.col_tiles == 1 for c in decode)
    groups = [c for c in prefill if c.col_tiles > 1]
    assert groups and all(c.block_k == 64 for c in groups), "a group holds the whole rank of v"
    assert all(c.block_n * c.col_tiles <= 128 for c in narrow if c.col_tiles > 1) and \
        not any(c.col_tiles > 1 and c.block_n == 128 for c in narrow)
