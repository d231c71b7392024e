"""bench/fp8_decode_sweep.py on the CPU (Triton's interpreter, one call a timing): every candidate config
computes the same product, the table's own choice leads, and the report names the best per projection."""

from __future__ import annotations

import time

import pytest
import torch

from bench.fp8_decode_sweep import SHAPES_7B, best_lines, candidates, main, sweep
from vlora_kernels.fp8 import quantize_rows_ref, quantize_weight
from vlora_kernels.fp8_decode import decode_config, fp8_decode_mm, fp8_decode_mm_ref


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def test_candidates_start_with_the_table_and_never_leave_a_split_empty():
    for n, k in SHAPES_7B.values():
        cands = candidates(n, k)
        assert cands[0] == decode_config(n, k) and len(set(cands)) == len(cands) > 10
        for block_n, block_k, split, _, stages in cands:
            tiles = -(-k // block_k)
            assert -(-tiles // split) * (split - 1) < tiles
            assert stages * (block_n + 64) * block_k <= 227 << 10  # (128, 256) x 5 stages is 240 KB: refused


def test_every_candidate_computes_the_same_product():
    g = torch.Generator().manual_seed(0)
    (q_x, s_x), (q_w, s_w) = quantize_rows_ref(torch.randn(5, 320, generator=g)), quantize_weight(
        torch.randn(136, 320, generator=g))
    ref = fp8_decode_mm_ref(q_x, s_x, q_w, s_w)
    for cfg in candidates(136, 320)[::3]:
        torch.testing.assert_close(fp8_decode_mm(q_x, s_x, q_w, s_w, config=cfg).float(), ref, rtol=2.0 ** -7,
                                   atol=1e-3 * ref.abs().max().item())
    with pytest.raises(ValueError, match="config"):
        fp8_decode_mm(q_x, s_x, q_w, s_w, config=(64, 128, 4, 4, 3))  # 3 K tiles cannot make 4 splits
    with pytest.raises(ValueError, match="BLOCK_N"):
        fp8_decode_mm(q_x, s_x, q_w, s_w, config=(48, 128, 1, 4, 3))


def test_narrow_channel_tiles_compute_the_same_product_with_few_splits():
    # 16 and 32 channels a program (mma.sync, each e4m3 tile widened to f16 in registers): 136 channels leave a
    # partial last tile, 320 columns of K a partial last K tile
    g = torch.Generator().manual_seed(1)
    (q_x, s_x), (q_w, s_w) = quantize_rows_ref(torch.randn(3, 320, generator=g)), quantize_weight(
        torch.randn(136, 320, generator=g))
    ref = fp8_decode_mm_ref(q_x, s_x, q_w, s_w)
    cands = candidates(136, 320, block_ns=(16, 32))[1:]
    assert {c[0] for c in cands} == {16, 32} and {c[2] for c in cands} == {1, 2} and {c[3] for c in cands} == {2, 4}
    for cfg in cands[::3]:
        torch.testing.assert_close(fp8_decode_mm(q_x, s_x, q_w, s_w, config=cfg).float(), ref, rtol=2.0 ** -7,
                                   atol=1e-3 * ref.abs().max().item())


def test_a_failing_candidate_is_a_row_not_the_end_of_the_sweep():
    calls = []

    def timed(fn):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of resources: shared memory\nmore")
        return _once(fn)

    rows = sweep({"tiny_proj": (72, 256)}, [2], "cpu", timed, block_ns=(16,))
    assert len(rows) == len(calls) and rows[1]["us"] != rows[1]["us"]
    assert rows[1]["error"] == "RuntimeError: out of resources: shared memory"
    lines = best_lines(rows)
    assert lines[-1].startswith("failed: tiny_proj m=2 ") and "best" in lines[0]


def test_sweep_rows_and_report_on_a_tiny_shape():
    rows = sweep({"tiny_proj": (72, 256)}, [1, 17], "cpu", _once)
    per_m = len(candidates(72, 256))
    assert len(rows) == 2 * per_m and all(r["us"] > 0 and r["tb_s"] > 0 for r in rows)
    assert [r["table"] for r in rows[:per_m]] == [True] + [False] * (per_m - 1)
    lines = best_lines(rows)
    assert lines[0].strip().startswith("tiny_proj m=1") and "best" in lines[0] and "table" in lines[0]
    assert lines[-2] == "CONFIGS (the best summed over the token counts):" and lines[-1].startswith("    (72, 256): (")


def test_weight_only_sweep_times_the_bf16_token_form():
    rows = sweep({"tiny_proj": (72, 256)}, [3], "cpu", _once, weight_only=True)
    assert len(rows) == len(candidates(72, 256, weight_only=True)) and all(r["us"] > 0 for r in rows)
    assert best_lines(rows, {}, "W_CONFIGS")[-2] == "W_CONFIGS (the best summed over the token counts):"
    for block_n, block_k, _, _, stages in candidates(3584, 18944, weight_only=True):
        assert stages * (block_n + 128) * block_k <= 227 << 10  # the tokens' tile is bf16: twice the bytes


def test_the_command_refuses_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit, match="CUDA GPU"):
        main(["--m", "1"])
