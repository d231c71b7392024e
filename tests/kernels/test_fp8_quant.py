"""vlora_kernels/fp8.py on the CPU: quantize / dequantize against fp32, per-token scaling (the Triton kernel
through the interpreter against its PyTorch reference, byte for byte) and the FP8 GEMM against a
fp32 matmul of the dequantized operands."""

from __future__ import annotations

import pytest
import torch

from vlora_kernels.fp8 import (FP8_DTYPE, FP8_MAX, SCALE_FLOOR, dequantize, fp8_linear, quantize_rows_ref,
                         quantize_rows_triton, quantize_weight)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernel: on the GPU, else interpreted
# e4m3 keeps 3 mantissa bits: round to nearest is off by at most 2**-4 of the value (normal range)
REL_STEP = 2.0 ** -4


def test_weight_round_trip_is_within_half_an_fp8_step_per_element():
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 48)[:, None]
    q, scale = quantize_weight(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (48,) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, w.abs().amax(1) / FP8_MAX)
    back = dequantize(q, scale)
    # each row's largest entry lands on 448 exactly; small entries fall into the subnormals, whose
    # step is 2**-9 of the scale
    err = (back - w).abs()
    bound = torch.maximum(w.abs() * REL_STEP, scale[:, None] * 2.0 ** -10)
    assert bool((err <= bound * 1.0001).all())
    torch.testing.assert_close(back.abs().amax(1), w.abs().amax(1), rtol=1e-6, atol=0)  # amax -> 448 exactly


def test_stacked_weights_quantize_per_layer_and_row():
    w = torch.randn(3, 8, 32)
    q, scale = quantize_weight(w)
    assert scale.shape == (3, 8)
    for layer in range(3):
        q1, s1 = quantize_weight(w[layer])
        assert torch.equal(q[layer].view(torch.uint8), q1.view(torch.uint8)) and torch.equal(scale[layer], s1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 37, 2048, 3000])
def test_per_token_scaling_triton_matches_reference_byte_for_byte(dtype, k):
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(k)).to(dtype=dtype, device=DEVICE)
    x[1] = 0  # all-zero row: finite scale, zeros out
    x[2, k // 2] = 1e30 if dtype == torch.float32 else 3e38  # one huge value dominates its row
    q_ref, s_ref = quantize_rows_ref(x)
    q, s = quantize_rows_triton(x)
    assert s.shape == (6, 1) and torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert s[1].item() == pytest.approx(SCALE_FLOOR) and not q[1].float().any()
    assert q[2, k // 2].float().item() == FP8_MAX
    assert torch.isfinite(q.float()).all() and torch.isfinite(s).all()
    err = (q.float() * s - x.float()).abs()
    rows = [0, 3, 4, 5]
    assert bool((err[rows] <= torch.maximum(x.float()[rows].abs() * REL_STEP, s[rows] * 2.0 ** -10) * 1.0001).all())


def test_empty_batch_quantizes_to_empty():
    q, s = quantize_rows_triton(torch.zeros(0, 64, device=DEVICE))
    assert q.shape == (0, 64) and s.shape == (0, 1) and q.dtype == FP8_DTYPE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_fp32_matmul_of_dequantized_operands(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 128, generator=gen).to(dtype)
    w = torch.randn(80, 128, generator=gen) * 0.05
    bias = torch.randn(80, generator=gen).to(dtype)
    q_w, s_w = quantize_weight(w)
    y = fp8_linear(x, q_w, s_w, bias)
    assert y.dtype == dtype and y.shape == (9, 80)
    q_x, s_x = quantize_rows_ref(x)
    ref = dequantize(q_x, s_x.squeeze(1)) @ dequantize(q_w, s_w).T + bias.float()
    # only the output's own rounding remains (fp32 exact; bf16 one rounding of 2**-8)
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -8
    torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
    # and against the unquantized product: FP8's error on both operands, a few percent of the scale
    exact = x.float() @ w.T + bias.float()
    assert (y.float() - exact).abs().max() <= 4 * REL_STEP * (x.float().abs() @ w.abs().T).max()
