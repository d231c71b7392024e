"""bench.handoff: its correctness check and its refusals (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

import bench.handoff
from bench.handoff import check, main
from kernels.tiling import handoff_space
from kernels.segments import build_segments
from kernels.tiling import TileConfig
from kernels.workload import LoRAShape, make_problem


def _problem(tokens: int, mix: str):
    shape = LoRAShape(tokens, mix, 16, 64, (48,))
    y, x, lora_a, lora_b, slot_ids, ranks, scales = make_problem(shape, torch.float16, "cpu", seed=1, n_slots=8)
    return y, x, lora_a, lora_b, build_segments(slot_ids, "cpu"), ranks, scales, shape.slices


@pytest.mark.parametrize("tokens, mix", [(1, "identical"), (5, "distinct")])
def test_check_agrees_with_the_two_launches_and_catches_a_wrong_kernel(tokens, mix, monkeypatch):
    problem = _problem(tokens, mix)
    cfg = TileConfig(16, 16, 16, split_k=2, col_tiles=2)
    assert check(problem, cfg) < 1e-2 and check(problem, cfg, tickets=False) < 1e-2
    real = bench.handoff.handoff_add_lora
    monkeypatch.setattr(bench.handoff, "handoff_add_lora", lambda y, *a, **kw: real(real(y, *a, **kw), *a, **kw))  # adds twice
    assert check(problem, cfg) > 0.5


@pytest.mark.parametrize("tokens, segments, seg_len", [(1, 1, 1), (8, 8, 1), (32, 8, 16), (64, 64, 1), (64, 1, 64)])
def test_the_space_fits_the_batch(tokens, segments, seg_len):
    space = handoff_space(tokens, segments, seg_len, 4096, 4096, 1)
    assert space and len(set(space)) == len(space)
    assert all(c.block_m <= max(16, 2 * seg_len) for c in space), "no token tile far taller than the segment"
    assert all(c.split_k * c.block_k <= 4096 for c in space), "no split without K"


def test_refuses_prefill_sizes_and_a_machine_without_a_gpu(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="<= 64 tokens"):
        main(["--tokens", "128", "--out", str(tmp_path / "o")])
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        main(["--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
