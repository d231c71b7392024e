"""bench.prefill_parts: its fused tiling space and its dense cuBLAS reference (the timing itself
needs a GPU)."""

from __future__ import annotations

import pytest

import torch

from bench.prefill_parts import dense_op, dense_problem, fused_space, main
from kernels.reference import lora_reference
from kernels.segments import build_segments
from kernels.workload import LoRAShape, make_problem


@pytest.mark.parametrize("rank", [16, 64, 128])
def test_fused_space_fits_and_spans_at_least_512_columns(rank):
    space = fused_space(rank)
    assert space and len(set(space)) == len(space)
    assert all(c.smem_bytes(2, rank=rank) <= 227 * 1024 and c.block_n * c.col_tiles >= 512 for c in space)
    assert all(c.split_k == 1 for c in space), "the fused kernel reduces the whole K in each program"


def test_refuses_without_a_gpu_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        main(["--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("rank", [1, 16])
def test_the_dense_reference_is_the_same_op_for_one_adapter(rank):
    shape = LoRAShape(37, "identical", rank, 96, (80,))
    y, x, lora_a, lora_b, slot_ids, ranks, scales = make_problem(shape, torch.float32, "cpu", seed=3)
    scales[int(slot_ids[0])] = 0.5  # a scale other than the workload's, so a dropped alpha shows
    meta = build_segments(slot_ids, "cpu")
    before, want = y.clone(), y.clone()
    lora_reference(want, x, lora_a, lora_b, meta, ranks, scales, shape.slices)
    d = dense_problem((y, x, lora_a, lora_b, meta, ranks, scales, shape.slices))
    dense_op(d)
    assert not torch.allclose(y, before)  # the op added to y in place
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
