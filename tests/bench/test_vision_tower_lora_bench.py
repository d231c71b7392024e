"""`vlora bench bench.suite=vision bench.vision.tower_lora=true`: the tower-LoRA columns (bench/vision_lora.py),
on the CPU with a small tower (the suite itself runs in tests/bench/test_vision_bench.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from vlora.config import compose, to_dataclass

GRIDS = [(1, 4, 4), (1, 2, 6)]


@pytest.fixture(scope="module")
def tower():
    from serve.models.qwen_vision import QwenVisionTower

    vc = SimpleNamespace(embed_dim=32, hidden_size=48, mlp_ratio=2, num_heads=2, spatial_merge_size=2, patch_size=14,
                         temporal_patch_size=2, in_channels=3, depth=2, hidden_act="quick_gelu", window_size=112)
    torch.manual_seed(0)
    return QwenVisionTower(vc, "qwen2_vl").eval()


def test_the_option_reaches_the_suites_job(vlora_home):
    from bench.vision import VisionBenchJob

    cfg = compose("bench", ["bench.suite=vision", "bench.vision.tower_lora=true"])
    job = to_dataclass(VisionBenchJob, cfg.bench.vision)
    assert job.tower_lora and job.tower_lora_rank == 16


def test_the_columns_time_the_pass_with_and_without_adapters(tower):
    from bench.vision_lora import time_tower_lora

    def time_ms(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    with torch.no_grad():
        row = time_tower_lora(tower, torch.randn(28, 3 * 2 * 14 * 14), GRIDS, 16, 2, time_ms)
    assert set(row) == {"tower_ms_per_chunk_no_lora", "tower_lora_ms_per_chunk", "tower_lora_mixed_ms_per_chunk",
                        "tower_lora_overhead", "tower_lora_mixed_overhead"}
    assert all(v > 0 for v in row.values())
    assert not tower._forward_hooks and not tower.blocks[0].attn.qkv._forward_hooks  # the hooks are gone after


def test_the_benchmarks_adapters_change_the_towers_output(tower):
    from bench.vision_lora import random_tower_adapters
    from serve.lora.tower import TowerLoRA

    pixels = torch.randn(28, 3 * 2 * 14 * 14)
    lora = TowerLoRA(None, tower, random_tower_adapters(tower, 2, 16, torch.float32, "cpu"), "torch")
    try:
        with torch.no_grad():
            plain = tower(pixels, tower.layout(GRIDS))
            lora.bind([1, -1], [16, 12])
            adapted = tower(pixels, tower.layout(GRIDS))
    finally:
        lora.remove()
    assert (adapted[:4] - plain[:4]).abs().max() > 1e-3  # the first item's 16 rows merge into 4
    assert torch.equal(adapted[4:], plain[4:])  # the second item has no adapter
