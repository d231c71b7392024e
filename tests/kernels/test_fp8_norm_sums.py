"""A split FP8 decode GEMM whose partial sums are left to the fused norm after it (fp8_decode_mm's defer_sums,
serve/models/fp8.py's NORM_SUMS): the norm sums them exactly as the reduction kernel would, so its output, the
residual stream, its FP8 rows and the projection's own output are the bytes of reduction-then-norm. The
interpreter on the CPU at small shapes; compiled on a GPU at the 7B's o_proj and down_proj shapes."""

from __future__ import annotations

import pytest
import torch

from vlora_kernels.fp8 import attached_rows, quantize_rows_ref, quantize_weight
from vlora_kernels.fp8_decode import _SUMS_ATTR, finish_sums, fp8_decode_mm, split_sums, take_sums
from vlora_kernels.fp8_fused import rms_norm_fp8
from serve.models.layers import written

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _operands(m: int, n: int, k: int, groups: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, groups, k // groups, generator=g) * torch.logspace(-2, 1, groups)[None, :, None]
    q_x, s_x = quantize_rows_ref(x.reshape(m * groups, k // groups).to(DEV))
    q_w, s_w = quantize_weight((torch.randn(n, k, generator=g) * 0.02).to(DEV))
    return q_x.reshape(m, k), s_x.reshape(m, groups), q_w, s_w


def _rows(y: torch.Tensor):
    q, s = attached_rows(y)
    return q.view(torch.uint8), s


def _check(m, n, k, groups, config, bias: bool, seed: int = 0):
    q_x, s_x, q_w, s_w = _operands(m, n, k, groups, seed)
    g = torch.Generator().manual_seed(seed + 1)
    b = (torch.randn(n, generator=g) * 0.1).to(DEV, torch.bfloat16) if bias else None
    residual = torch.randn(m, n, generator=g).to(DEV, torch.bfloat16)
    weight = (torch.rand(n, generator=g) + 0.5).to(DEV, torch.bfloat16)
    y = fp8_decode_mm(q_x, s_x, q_w, s_w, config=config, bias=b)
    want_out, want_res = rms_norm_fp8(y, weight, 1e-6, residual)
    owed = fp8_decode_mm(q_x, s_x, q_w, s_w, config=config, bias=b, defer_sums=True)
    sums = split_sums(owed)
    assert sums is not None and sums.part.shape == (config[2], m, n)
    out, res = rms_norm_fp8(owed, weight, 1e-6, residual)
    assert split_sums(owed) is None  # taken by the norm, which also wrote y itself
    assert torch.equal(owed, y) and torch.equal(out, want_out) and torch.equal(res, want_res)
    for got, want in zip(_rows(out), _rows(want_out)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("groups, bias", [(1, False), (1, True), (2, False)])
def test_the_norm_sums_a_split_gemm_as_the_reduction_does(groups, bias):
    # 136 channels: a ragged last block of the norm's row; 3 splits of K; 2 groups: the scales applied in the GEMM
    _check(3, 136, 512, groups, (64, 128, 2 if groups == 2 else 3, 4, 3), bias)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [1, 32])
def test_the_norm_sums_the_7b_o_and_down_projections_as_the_reduction_does(m):
    _check(m, 3584, 3584, 4, (64, 128, 4, 4, 4), False, seed=m)  # o_proj behind the attention's grouped rows
    _check(m, 3584, 18944, 1, (64, 128, 4, 4, 5), False, seed=m)  # down_proj behind the SiLU-mul's rows


def test_any_other_reader_gets_y_written_once():
    q_x, s_x, q_w, s_w = _operands(2, 64, 512, 1, 3)
    y = fp8_decode_mm(q_x, s_x, q_w, s_w, config=(64, 128, 2, 4, 3))
    owed = fp8_decode_mm(q_x, s_x, q_w, s_w, config=(64, 128, 2, 4, 3), defer_sums=True)
    assert written(owed) is owed and split_sums(owed) is None and torch.equal(owed, y)
    assert finish_sums(owed) is owed  # nothing owed any more: no second reduction
    unsplit = fp8_decode_mm(q_x, s_x, q_w, s_w, config=(64, 128, 1, 4, 3), defer_sums=True)
    assert split_sums(unsplit) is None  # one launch wrote it: nothing to leave
    plain = torch.ones(3)
    assert written(plain) is plain


def test_partial_sums_that_do_not_fit_the_norm_are_refused():
    q_x, s_x, q_w, s_w = _operands(2, 64, 512, 1, 4)
    owed = fp8_decode_mm(q_x, s_x, q_w, s_w, config=(64, 128, 2, 4, 3), defer_sums=True)
    other = torch.zeros(1, 64, device=DEV, dtype=torch.bfloat16)  # another tensor made to owe owed's sums
    other.__dict__[_SUMS_ATTR] = take_sums(owed)
    with pytest.raises(ValueError, match="partial sums .* do not fit x"):
        rms_norm_fp8(other, torch.ones(64, device=DEV, dtype=torch.bfloat16), 1e-6)
