"""bench.prefill_parts: its fused tiling space (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest

from bench.prefill_parts import fused_space, main


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
