"""vlora_kernels/interpreter.py quotient_rn: the FP8 quantizers' per-element division, done on the GPU as a
reciprocal, a multiply and Markstein's two-FMA correction, must round exactly as IEEE division (torch's x / scale,
the reference every FP8 byte is compared with). The algorithm is checked here in exact rational arithmetic; its
compiled form on the GPU test, against torch's division."""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest
import torch


def _rn32(v: Fraction) -> Fraction:
    """v rounded to the nearest float32 (ties to even), subnormals included; no overflow here."""
    if v == 0:
        return Fraction(0)
    sign, a = (-1 if v < 0 else 1), abs(v)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2^e <= a < 2^(e+2)
    if a >= Fraction(2) ** (e + 1):
        e += 1
    if a < Fraction(2) ** e:
        e -= 1
    e = max(e, -126)  # subnormals: a fixed quantum of 2^-149
    scaled = a * Fraction(2) ** (23 - e)
    m, rest = divmod(scaled.numerator, scaled.denominator)
    if 2 * rest > scaled.denominator or (2 * rest == scaled.denominator and m % 2):
        m += 1
    return sign * Fraction(m) * Fraction(2) ** (e - 23)


def _markstein(x: Fraction, d: Fraction) -> Fraction:
    r = _rn32(1 / d)
    q = _rn32(x * r)
    if x == 0:
        return q
    residual = _rn32(x - q * d)  # an fma: the product exact, one rounding
    return _rn32(residual * r + q)


def _float32s(rng: random.Random, n: int, lo: int, hi: int) -> list[float]:
    """n float32 values: random 24-bit mantissas (all-ones and powers of two among them), exponents in [lo, hi]."""
    out = []
    for i in range(n):
        mantissa = (1 << 24) - 1 if i % 17 == 0 else (1 << 23) if i % 19 == 0 else rng.randrange(1 << 23, 1 << 24)
        out.append(float(np.float32(mantissa * 2.0 ** (rng.randint(lo, hi) - 23))))
    return out


def test_markstein_correction_rounds_as_ieee_division():
    rng = random.Random(0)
    xs = _float32s(rng, 6000, -30, 9)
    ds = _float32s(rng, 6000, -40, 3)
    wrong_plain = 0
    for x, d in zip(xs, ds):
        x = x if rng.random() < 0.5 else -x
        fx, fd = Fraction(x), Fraction(d)
        want = _rn32(fx / fd)
        assert float(want) == float(np.float32(x) / np.float32(d))  # the oracle is numpy's IEEE float32 division
        assert _markstein(fx, fd) == want, (x, d)
        wrong_plain += _rn32(fx * _rn32(1 / fd)) != want
    assert wrong_plain > 100  # a multiply by the reciprocal alone misses often: the correction is what makes it exact


@pytest.mark.gpu
def test_quotient_rn_on_the_gpu_is_torch_division_bit_for_bit():
    import triton
    import triton.language as tl

    from vlora_kernels.interpreter import quotient_rn

    @triton.jit
    def _divide(x_ptr, d_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        d = tl.load(d_ptr + offs, mask=mask, other=1.0)
        tl.store(out_ptr + offs, quotient_rn(x, d), mask=mask)

    g = torch.Generator(device="cuda").manual_seed(0)
    n = 1 << 24
    # activations over a wide range, divided by scales from the floor up to large ones; -0 among them
    x = torch.randn(n, device="cuda", generator=g) * torch.exp2(torch.randint(-30, 12, (n,), device="cuda", generator=g))
    x[::1001] = -0.0
    d = torch.rand(n, device="cuda", generator=g).add_(0.5) * torch.exp2(
        torch.randint(-40, 4, (n,), device="cuda", generator=g)).clamp_min(1e-12)
    out = torch.empty_like(x)
    _divide[(triton.cdiv(n, 1024),)](x, d, out, n, BLOCK=1024)
    want = x / d
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
