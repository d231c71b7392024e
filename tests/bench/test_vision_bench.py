"""`vlora bench bench.suite=vision` on the CPU with the tiny model: rows, meta and files."""

from __future__ import annotations

import csv
import json

import pytest

from vlora.commands.bench import run
from vlora.config import compose


def test_vision_suite_on_cpu(vlora_home, tmp_path):
    # 112 x 112 frames: 4 attention windows per frame, so a wrong window order shows in the output
    cfg = compose("bench", ["bench.suite=vision", "bench.vision.device=cpu", "bench.vision.dtype=float32",
                            "bench.vision.model=qwen2_5_vl_tiny", "bench.vision.image_size=112",
                            "bench.vision.chunks=[1,3]", "bench.vision.repeats=2", "bench.vision.cpu_repeats=2",
                            f"bench.out_dir={tmp_path}"])
    result = run(cfg)
    rows, meta = result["vision"], result["meta"]
    assert [r["chunks"] for r in rows] == [1, 3] and [r["frame_groups"] for r in rows] == [3, 9]
    for r in rows:
        assert r["transformers_ms_per_chunk"] > 0 and r["ours_batched_ms_per_chunk"] > 0 and r["speedup"] > 0
        assert r["rel_diff_vs_transformers"] < 1e-4  # fp32: the same tower
        assert r["ours_syncs_per_step"] is None  # counted on a GPU only
    assert meta["cpu_per_chunk"]["host_ms"] > 0 and meta["cpu_per_chunk"]["device_path_host_ms"] > 0
    out = tmp_path / "cpu"
    with open(out / "vision.csv", newline="") as f:
        assert [int(r["chunks"]) for r in csv.DictReader(f)] == [1, 3]
    assert json.loads((out / "vision.json").read_text())["meta"]["job"]["model"] == "qwen2_5_vl_tiny"


def test_the_profile_on_cpu_splits_the_towers_time_by_kind(vlora_home, tmp_path):
    cfg = compose("bench", ["bench.suite=vision", "bench.vision.device=cpu", "bench.vision.dtype=float32",
                            "bench.vision.model=qwen2_vl_tiny", "bench.vision.image_size=56", "bench.vision.chunks=[1]",
                            "bench.vision.repeats=1", "bench.vision.cpu_repeats=1", "bench.vision.profile=true",
                            "bench.vision.profile_chunks=2", "bench.vision.profile_repeats=1", f"bench.out_dir={tmp_path}"])
    profile = run(cfg)["meta"]["profile"]
    eager = profile["eager"]
    # the tiny tower's CPU operators: its linears, attention and norms each show as their kind
    assert {"matmul", "attention", "norm"} <= set(eager["kinds_ms"])
    assert sum(eager["kinds_ms"].values()) == pytest.approx(eager["busy_ms"])
    assert profile["sdpa_ms"] == {} and {"compiled", "graph_eager_ms", "chains_ms"}.isdisjoint(profile)  # GPU only
    names = [g["linear"] for g in profile["gemms"]]
    assert names[:2] == ["attn.qkv", "attn.proj"] and "patch_embed" in names and names[-1] == "merger.1"
    merger = profile["gemms"][-1]
    assert merger["m"] * 4 == profile["rows"] and all(g["bf16_ms"] > 0 and g["fp8_ms"] is None for g in profile["gemms"])
    saved = json.loads((tmp_path / "cpu" / "vision_profile.json").read_text())
    assert saved["profile"]["rows"] == profile["rows"]
