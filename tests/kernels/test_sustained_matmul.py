"""vlora_kernels.timing.sustained_matmul_tflops on a GPU: back-to-back products for the given time, then the rate of
the last quarter's batches (the streams suite's floor under full load)."""

from __future__ import annotations

import time

import pytest
import torch

from vlora_kernels.timing import matmul_tflops, sustained_matmul_tflops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sustained_rate_runs_for_its_time_and_is_a_matmul_rate():
    start = time.monotonic()
    got = sustained_matmul_tflops(1024, torch.bfloat16, seconds=1.0)
    assert 1.0 <= time.monotonic() - start < 10
    assert got["batches"] >= 4 and got["tflops"] > 0 and got["first_tflops"] > 0
    # the same product's burst rate: the sustained one may be lower (clocks), not several times off
    assert 0.2 < got["tflops"] / matmul_tflops(1024, torch.bfloat16) < 2.0
    assert got["sm_clock_mhz"] is None or got["sm_clock_mhz"] > 0
