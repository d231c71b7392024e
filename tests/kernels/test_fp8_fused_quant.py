"""vlora_kernels/fp8_fused.py: the RMSNorm and the SiLU-mul that also write their output's FP8 rows write the
same activation as the unfused kernels and the same FP8 bytes and scales as `quantize_rows` of it (the
interpreter on the CPU, compiled on a GPU); `fp8_linear` takes the attached rows instead of quantizing."""

from __future__ import annotations

import pytest
import torch
import triton

from vlora_kernels.fp8 import (FP8_DTYPE, FP8_MAX, ONE_PASS_MAX, attach_rows, attached_rows, fp8_linear, quantize_rows_ref,
                         quantize_rows_triton, quantize_weight)
from vlora_kernels.fp8_fused import rms_norm_fp8, rms_norm_fp8_ref, silu_mul_fp8, silu_mul_fp8_ref
from serve.models.fused import rms_norm, silu_and_mul

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _same_rows(y: torch.Tensor) -> None:
    q, s = attached_rows(y)
    q_ref, s_ref = quantize_rows_ref(y)
    assert q.dtype == FP8_DTYPE and s.shape == (y.shape[0], 1)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [96, 1000])
def test_rms_norm_fp8_is_the_norm_kernel_then_quantize_rows_byte_for_byte(dtype, dim):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(5, dim, generator=g).to(DEV, dtype)
    residual = torch.randn(5, dim, generator=g).to(DEV, dtype)
    x[1], residual[1] = 0, 0  # an all-zero row: finite scale, zero bytes
    weight = (torch.rand(dim, generator=g) + 0.5).to(DEV, dtype)
    weight[dim // 3] = 1e4  # one channel dominates every row's amax
    y = rms_norm_fp8(x, weight, 1e-6)
    assert torch.equal(y, rms_norm(x, weight, 1e-6))
    _same_rows(y)
    y, r = rms_norm_fp8(x, weight, 1e-6, residual)
    want_y, want_r = rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(y, want_y) and torch.equal(r, want_r) and attached_rows(r) is None
    _same_rows(y)
    q, s = attached_rows(y)
    assert not q[1].float().any() and q[0, dim // 3].float().abs().item() == FP8_MAX
    # and against the PyTorch arithmetic (the interpreter truncates float32 -> bfloat16 where torch rounds)
    ref_y, ref_r, _, ref_s = rms_norm_fp8_ref(x, weight, 1e-6, residual)
    tol = 0 if dtype == torch.float32 else 2 ** -6  # two roundings: the normed value and the weight product
    torch.testing.assert_close(y, ref_y, atol=tol * 1e4, rtol=max(tol, 1e-5))
    torch.testing.assert_close(s, ref_s, atol=0, rtol=max(tol, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [37, 3000])  # one column block, and three (BLOCK 1024) with a ragged end
def test_silu_mul_fp8_is_the_silu_kernel_then_quantize_rows_byte_for_byte(dtype, n):
    g = torch.Generator().manual_seed(n)
    gate_up = (3 * torch.randn(4, 2 * n, generator=g)).to(DEV, dtype)
    gate_up[2] = 0
    gate_up[1, n - 1], gate_up[1, 2 * n - 1] = 8.0, 40.0  # row 1's amax in its last block: every block's scale
    act = silu_mul_fp8(gate_up)
    assert act.shape == (4, n) and torch.equal(act, silu_and_mul(gate_up))
    _same_rows(act)
    ref_act, _, ref_s = silu_mul_fp8_ref(gate_up)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(act, ref_act, atol=tol, rtol=tol)
    torch.testing.assert_close(attached_rows(act)[1], ref_s, atol=0, rtol=tol)


@pytest.mark.parametrize("k", [3584, 9000])  # the 7B's hidden size, read once; a longer row, in two sweeps
def test_quantize_rows_reads_short_rows_once_and_long_rows_in_two_sweeps_with_the_same_bytes(k):
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)).to(DEV, torch.bfloat16)
    x[1, k - 1] = 500.0  # the amax in the last block
    q, s = quantize_rows_triton(x)
    q_ref, s_ref = quantize_rows_ref(x)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert (triton.next_power_of_2(k) <= ONE_PASS_MAX) == (k == 3584)


def test_empty_batches_carry_empty_rows():
    y = rms_norm_fp8(torch.zeros(0, 64, device=DEV), torch.ones(64, device=DEV), 1e-6)
    act = silu_mul_fp8(torch.zeros(0, 64, device=DEV))
    assert attached_rows(y)[0].shape == (0, 64) and attached_rows(act)[0].shape == (0, 32)


def test_fp8_linear_uses_the_attached_rows_and_views_carry_none():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g)
    q_w, s_w = quantize_weight(torch.randn(40, 64, generator=g))
    plain = fp8_linear(x, q_w, s_w)
    q, s = quantize_rows_ref(x)
    attach_rows(x, q, s)
    assert torch.equal(fp8_linear(x, q_w, s_w), plain)  # the right rows: the same product
    attach_rows(x, torch.zeros_like(q), s)  # rows that are not x's quantization: used as given
    assert not fp8_linear(x, q_w, s_w).any()
    assert attached_rows(x[:3]) is None and attached_rows(x.clone()) is None
    with pytest.raises(ValueError, match="do not fit"):
        attach_rows(x, q[:2], s)


def test_bad_shapes_are_refused_in_one_line():
    with pytest.raises(ValueError, match="contiguous last dim"):
        rms_norm_fp8(torch.zeros(4, 8).t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        rms_norm_fp8(torch.zeros(4, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match=r"\[T, 2 \* I\]"):
        silu_mul_fp8(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="dtype"):
        silu_mul_fp8(torch.zeros(2, 8, dtype=torch.int32))
