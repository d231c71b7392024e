"""vlora_kernels/fp8_decode.py: the decode-sized FP8 GEMM against the fp32 product of its dequantized operands
(the interpreter on the CPU, compiled on a GPU), its launch table, and fp8_linear's switch to it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from vlora_kernels import fp8, fp8_decode
from vlora_kernels.fp8 import quantize_rows_ref, quantize_weight, scaled_mm_rows
from vlora_kernels.fp8_decode import (CONFIGS, MAX_M, decode_activations, decode_config, decode_kernel_on, decode_max_m,
                                dequantize_rows, fp8_decode_mm, fp8_decode_mm_ref, fp8w_decode_mm, fp8w_decode_mm_ref,
                                gemm_pdl, group_scales_fit)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the bf16 output's rounding: to nearest on a GPU (2**-8 of a value at most); the interpreter truncates
# float32 -> bfloat16 (seen in Triton 3.8), off by up to 2**-7
BF16_REL = 2.0 ** -8 if DEV == "cuda" else 2.0 ** -7
SHAPES_7B = {"qkv_proj": (4608, 3584), "o_proj": (3584, 3584), "gate_up_proj": (37888, 3584),
             "down_proj": (3584, 18944)}


def _operands(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]  # scales differ per token
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, -1, n)[:, None]  # and per channel
    # fp8 made by torch (the interpreter rounds fp32 -> e4m3 wrongly), on the device the kernel runs on
    (q_x, s_x), (q_w, s_w) = quantize_rows_ref(x.to(DEV)), quantize_weight(w.to(DEV))
    return q_x, s_x, q_w, s_w


def _check(y: torch.Tensor, q_x, s_x, q_w, s_w, bias=None) -> None:
    ref = fp8_decode_mm_ref(q_x, s_x, q_w, s_w, bias)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape and torch.isfinite(y).all()
    # the bf16 output's rounding plus the fp32 accumulation's (far below, on the sum of |products|)
    bound = dequantize_rows(q_x, s_x).abs() @ (q_w.float().abs() * s_w[:, None]).T
    torch.testing.assert_close(y.float(), ref, rtol=BF16_REL, atol=1e-5 * bound.max().item())


def _group_operands(m: int, n: int, k: int, groups: int, seed: int):
    """x quantized per (token, group of k / groups columns), each group of its own magnitude: the decode
    attention's rows (one group per kv head)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, groups, k // groups, generator=g) * torch.logspace(-2, 1, groups)[None, :, None]
    q_x, s_x = quantize_rows_ref(x.reshape(m * groups, k // groups).to(DEV))
    _, _, q_w, s_w = _operands(1, n, k, seed)
    return q_x.reshape(m, k), s_x.reshape(m, groups), q_w, s_w


@pytest.mark.parametrize("split_k", [1, 4])  # 4: K's 5 tiles as 2+2+1+0 (the last split past K writes zeros)
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64])  # BLOCK_M 16, 16, 16, 64, 64: masked token rows
def test_decode_gemm_matches_dequantized_fp32_product(m, split_k):
    # N 200: three full channel tiles of 64 and a tail of 8; K 517: four tiles of 128 and a tail of 5
    q_x, s_x, q_w, s_w = _operands(m, 200, 517, seed=m)
    y = fp8_decode_mm(q_x, s_x, q_w, s_w, split_k=split_k)
    _check(y, q_x, s_x, q_w, s_w)
    if split_k > 1:  # the splits are summed in a fixed order: the same bits every run
        assert torch.equal(y, fp8_decode_mm(q_x, s_x, q_w, s_w, split_k=split_k))


@pytest.mark.parametrize("split_k, groups", [(1, 2), (2, 2), (4, 2), (3, 4), (1, 4)])
@pytest.mark.parametrize("m", [1, 7, 33])
def test_decode_gemm_scales_each_group_of_columns_by_its_own_scale(m, split_k, groups):
    """s_x [M, G]: K 1024 in G groups of 2 or 4 tiles; a split that would cut a group is widened to whole
    groups (3 splits of 4 groups: 2 groups each, the last split past K). With one scale per token instead,
    the product of these rows would be wrong by the groups' different magnitudes."""
    q_x, s_x, q_w, s_w = _group_operands(m, 200, 1024, groups, seed=m + groups)
    y = fp8_decode_mm(q_x, s_x, q_w, s_w, split_k=split_k)
    _check(y, q_x, s_x, q_w, s_w)
    ref_rows = fp8_decode_mm_ref(q_x, s_x[:, :1], q_w, s_w)  # the first group's scale for every column
    assert not torch.allclose(y.float(), ref_rows, rtol=0.1)


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("groups", [1, 2])
def test_decode_gemm_adds_the_bias_before_its_one_rounding(split_k, groups):
    q_x, s_x, q_w, s_w = _group_operands(5, 200, 512, groups, seed=11)
    bias = (torch.randn(200, generator=torch.Generator().manual_seed(1)) * 3).to(DEV, torch.bfloat16)
    y = fp8_decode_mm(q_x, s_x, q_w, s_w, split_k=split_k, bias=bias)
    _check(y, q_x, s_x, q_w, s_w, bias)
    with pytest.raises(ValueError, match="bias"):
        fp8_decode_mm(q_x, s_x, q_w, s_w, bias=bias[:100])


def test_scale_groups_that_cut_a_k_tile_are_refused_and_group_scales_fit_says_so():
    q_x, s_x, q_w, s_w = _group_operands(3, 64, 768, 3, seed=2)  # groups of 256 columns: 2 tiles each
    assert group_scales_fit(64, 768, 3) and group_scales_fit(3584, 3584, 4)  # the 7B's o_proj: 4 groups of 7
    _check(fp8_decode_mm(q_x, s_x, q_w, s_w), q_x, s_x, q_w, s_w)
    q_x, s_x, q_w, s_w = _group_operands(3, 64, 768, 12, seed=2)  # groups of 64 columns: half a tile
    assert not group_scales_fit(64, 768, 12) and not group_scales_fit(64, 768, 5)
    with pytest.raises(ValueError, match="not whole K tiles"):
        fp8_decode_mm(q_x, s_x, q_w, s_w)
    with pytest.raises(ValueError, match="G dividing K"):
        fp8_decode_mm(q_x, torch.ones(3, 5, device=DEV), q_w, s_w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("m", [1, 7, 33, 64])
def test_weight_only_gemm_matches_the_16_bit_activation_times_the_dequantized_weight(m, split_k, dtype):
    """fp8w_decode_mm: x never quantized, so the oracle is x itself (not its FP8 rows) times dequantize(W)."""
    g = torch.Generator().manual_seed(100 + m)
    x = (torch.randn(m, 517, generator=g) * torch.logspace(-2, 1, m)[:, None]).to(DEV, dtype)
    _, _, q_w, s_w = _operands(1, 200, 517, seed=m)
    y = fp8w_decode_mm(x, q_w, s_w, split_k=split_k)
    ref = fp8w_decode_mm_ref(x, q_w, s_w)
    assert y.dtype == dtype and y.shape == ref.shape and torch.isfinite(y).all()
    bound = x.float().abs() @ (q_w.float().abs() * s_w[:, None]).T
    rel = BF16_REL if dtype == torch.bfloat16 else 2.0 ** -10
    torch.testing.assert_close(y.float(), ref, rtol=rel, atol=1e-5 * bound.max().item())
    # against the FP8-activation GEMM the difference is x's rounding to e4m3 alone: far from equal
    q_x, s_x = quantize_rows_ref(x.float())
    assert not torch.equal(y.float(), fp8_decode_mm(q_x, s_x, q_w, s_w, split_k=split_k).float())
    if split_k > 1:
        assert torch.equal(y, fp8w_decode_mm(x, q_w, s_w, split_k=split_k))


@pytest.mark.parametrize("bad", ["m0", "m65", "dtype", "k", "weight"])
def test_weight_only_bad_operands_are_refused_with_one_line(bad):
    x = torch.zeros(MAX_M + 1, 32, dtype=torch.bfloat16, device=DEV)
    _, _, q_w, s_w = _operands(1, 16, 32, seed=0)
    args = dict(m0=(x[:0], q_w, s_w), m65=(x, q_w, s_w), dtype=(x[:2].float(), q_w, s_w), k=(x[:2, :16], q_w, s_w),
                weight=(x[:2], q_w.float(), s_w))[bad]
    with pytest.raises(ValueError, match="fp8w_decode_mm") as err:
        fp8w_decode_mm(*args)
    assert "\n" not in str(err.value)


def test_decode_activations_come_from_the_environment_once_at_import():
    assert decode_activations("bf16", {}) == "bf16" and decode_activations("bf16", {"VLORA_FP8_DECODE_ACTIVATIONS": "fp8"}) == "fp8"
    with pytest.raises(ValueError, match="VLORA_FP8_DECODE_ACTIVATIONS must be one of"):
        decode_activations("bf16", {"VLORA_FP8_DECODE_ACTIVATIONS": "int8"})
    assert fp8.DECODE_ACTIVATIONS == decode_activations("fp8")  # the faster form on an H200
    # the CPU never takes the weight-only path: a fused producer still writes its rows there
    assert fp8.rows_wanted(torch.zeros(4, 8, dtype=torch.bfloat16))


def test_split_k_and_one_pass_agree_on_a_scale_vector_of_shape_m():
    q_x, s_x, q_w, s_w = _operands(3, 96, 384, seed=5)
    one, split = fp8_decode_mm(q_x, s_x.view(-1), q_w, s_w, split_k=1), fp8_decode_mm(q_x, s_x, q_w, s_w, split_k=3)
    # the same fp32 products summed in another order, then one bf16 rounding each
    torch.testing.assert_close(one.float(), split.float(), rtol=2 * BF16_REL, atol=1e-6)


@pytest.mark.parametrize("bad", ["m0", "m65", "dtype", "k", "scale"])
def test_bad_operands_are_refused_with_one_line(bad):
    q_x, s_x, q_w, s_w = _operands(MAX_M + 1, 16, 32, seed=0)
    args = dict(m0=(q_x[:0], s_x[:0], q_w, s_w), m65=(q_x, s_x, q_w, s_w),
                dtype=(q_x[:2].float(), s_x[:2], q_w, s_w), k=(q_x[:2, :16], s_x[:2], q_w, s_w),
                scale=(q_x[:2], s_x[:3], q_w, s_w))[bad]
    with pytest.raises(ValueError, match="fp8_decode_mm") as err:
        fp8_decode_mm(*args)
    assert "\n" not in str(err.value)


def test_launch_table_fills_132_sms_with_no_empty_split():
    for name, (n, k) in SHAPES_7B.items():
        assert (n, k) in CONFIGS, name
    # the table's shapes, a tensor-parallel half of each (the fallback), and a small model's
    for n, k in [*SHAPES_7B.values(), *((n // 2, k) for n, k in SHAPES_7B.values()), (2304, 9472), (64, 48)]:
        block_n, block_k, split, warps, stages = decode_config(n, k)
        k_tiles = triton.cdiv(k, block_k)
        per_split = triton.cdiv(k_tiles, split)
        assert per_split * (split - 1) < k_tiles, (n, k)  # every split reads some of K
        if n >= 2048:
            assert triton.cdiv(n, block_n) * split >= 132, (n, k)
        assert block_n in (64, 128) and warps * 32 * block_n // 64 >= 128 and stages >= 2
    assert decode_config(3584, 3584, split_k=100)[2] == 28  # an override is clamped to K's tiles


def test_decode_max_m_comes_from_the_environment_once_at_import():
    assert decode_max_m(0, {}) == 0 and decode_max_m(5, {"VLORA_FP8_DECODE_MAX_M": " "}) == 5
    assert decode_max_m(0, {"VLORA_FP8_DECODE_MAX_M": "64"}) == 64
    for raw in ("65", "-1", "1.5", "all"):
        with pytest.raises(ValueError, match=r"VLORA_FP8_DECODE_MAX_M must be an integer from 0 to 64"):
            decode_max_m(0, {"VLORA_FP8_DECODE_MAX_M": raw})
    assert fp8.DECODE_KERNEL_MAX_M == decode_max_m(64)  # every decode size unless this run's environment says
    # on Hopper, where it was tuned; on another FP8 GPU (Ada, 8.9) only when the variable asks for it
    assert decode_kernel_on((9, 0), {}) and not decode_kernel_on((8, 9), {}) and not decode_kernel_on((10, 0), {})
    assert decode_kernel_on((8, 9), {"VLORA_FP8_DECODE_MAX_M": "32"})
    env = {**os.environ, "VLORA_FP8_DECODE_MAX_M": "48", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", "import vlora_kernels.fp8 as f; print(f.DECODE_KERNEL_MAX_M)"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout.strip() == "48", done.stderr[-500:]


def test_gemm_pdl_comes_from_the_environment_once_at_import():
    assert gemm_pdl({}) and gemm_pdl({"VLORA_FP8_GEMM_PDL": "1"}) and not gemm_pdl({"VLORA_FP8_GEMM_PDL": "0"})
    for raw in ("yes", "2", ""):
        with pytest.raises(ValueError, match="VLORA_FP8_GEMM_PDL must be 0 or 1"):
            gemm_pdl({"VLORA_FP8_GEMM_PDL": raw})
    assert fp8_decode.GEMM_PDL == gemm_pdl()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES_7B))
@pytest.mark.parametrize("m", [1, 7, 32, 64])
def test_decode_gemm_at_the_7b_shapes_on_a_gpu(name, m, monkeypatch):
    n, k = SHAPES_7B[name]
    q_x, s_x, q_w, s_w = _operands(m, n, k, seed=m)
    y = fp8_decode_mm(q_x, s_x, q_w, s_w)
    _check(y, q_x, s_x, q_w, s_w)
    # launched with PDL behind the quantization (its weight prefetched meanwhile) or after it: the same bits
    q_x2, s_x2 = fp8.quantize_rows(q_x.float() * s_x)  # a Triton producer that lets the GEMM launch early
    with_pdl = fp8_decode_mm(q_x2, s_x2, q_w, s_w)
    monkeypatch.setattr(fp8_decode, "GEMM_PDL", not fp8_decode.GEMM_PDL)
    assert torch.equal(with_pdl, fp8_decode_mm(q_x2, s_x2, q_w, s_w))
    # cuBLAS's rowwise GEMM: the same products, its own summation order and bf16 rounding
    torch.testing.assert_close(y.float(), scaled_mm_rows(q_x, s_x, q_w, s_w).float(),
                               rtol=2.0 ** -7, atol=1e-4 * y.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 32, 64])
def test_grouped_o_proj_and_biased_qkv_at_the_7b_shapes_on_a_gpu(m, monkeypatch):
    """o_proj's rows from the decode attention (4 kv head groups of 896 columns) and qkv_proj's bias, each
    with and without PDL behind a producer: the same bits."""
    q_x, s_x, q_w, s_w = _group_operands(m, *SHAPES_7B["o_proj"], 4, seed=m)
    y = fp8_decode_mm(q_x, s_x, q_w, s_w)
    _check(y, q_x, s_x, q_w, s_w)
    monkeypatch.setattr(fp8_decode, "GEMM_PDL", not fp8_decode.GEMM_PDL)
    assert torch.equal(y, fp8_decode_mm(q_x, s_x, q_w, s_w))
    q_x, s_x, q_w, s_w = _operands(m, *SHAPES_7B["qkv_proj"], seed=m)
    bias = torch.randn(SHAPES_7B["qkv_proj"][0], device=DEV).to(torch.bfloat16)
    _check(fp8_decode_mm(q_x, s_x, q_w, s_w, bias=bias), q_x, s_x, q_w, s_w, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("block_n, split, warps", [(16, 1, 2), (32, 1, 4), (16, 2, 4)])
@pytest.mark.parametrize("m", [1, 32])
def test_narrow_channel_tiles_at_the_7b_shapes_on_a_gpu(block_n, split, warps, m):
    """BLOCK_N under 64 (mma.sync on widened tiles), unsplit or split in two, grouped o_proj rows included."""
    for name in ("qkv_proj", "down_proj"):
        q_x, s_x, q_w, s_w = _operands(m, *SHAPES_7B[name], seed=m)
        _check(fp8_decode_mm(q_x, s_x, q_w, s_w, config=(block_n, 128, split, warps, 4)), q_x, s_x, q_w, s_w)
    q_x, s_x, q_w, s_w = _group_operands(m, *SHAPES_7B["o_proj"], 4, seed=m)
    _check(fp8_decode_mm(q_x, s_x, q_w, s_w, config=(block_n, 128, split, warps, 4)), q_x, s_x, q_w, s_w)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES_7B))
@pytest.mark.parametrize("m", [1, 32, 64])
def test_weight_only_gemm_at_the_7b_shapes_on_a_gpu(name, m):
    n, k = SHAPES_7B[name]
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(DEV, torch.bfloat16)
    _, _, q_w, s_w = _operands(1, n, k, seed=m)
    y = fp8w_decode_mm(x, q_w, s_w)
    bound = x.float().abs() @ (q_w.float().abs() * s_w[:, None]).T
    torch.testing.assert_close(y.float(), fp8w_decode_mm_ref(x, q_w, s_w), rtol=BF16_REL, atol=1e-5 * bound.max().item())


@pytest.mark.gpu
def test_fp8_linear_takes_bf16_activations_at_decode_sizes(monkeypatch):
    monkeypatch.setattr(fp8, "DECODE_KERNEL_MAX_M", 8)
    monkeypatch.setattr(fp8, "DECODE_ACTIVATIONS", "bf16")
    g = torch.Generator().manual_seed(4)
    q_w, s_w = quantize_weight((torch.randn(384, 256, generator=g) * 0.05).to(DEV))
    for m in (1, 8, 9):
        x = torch.randn(m, 256, generator=g).to(DEV, torch.bfloat16)
        q_x, s_x = fp8.quantize_rows(x)
        want = fp8w_decode_mm(x, q_w, s_w) if m <= 8 else scaled_mm_rows(q_x, s_x, q_w, s_w)
        assert torch.equal(fp8.fp8_linear(x, q_w, s_w), want) and fp8.rows_wanted(x) == (m > 8)
        # rows a producer attached anyway are not read at decode sizes
        assert torch.equal(fp8.fp8_linear(fp8.attach_rows(x.clone(), q_x, s_x), q_w, s_w), want)


@pytest.mark.gpu
def test_fp8_linear_runs_the_decode_kernel_up_to_its_threshold(monkeypatch):
    monkeypatch.setattr(fp8, "DECODE_KERNEL_MAX_M", 8)
    monkeypatch.setattr(fp8, "DECODE_ACTIVATIONS", "fp8")
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(384, 256, generator=g) * 0.05).to(DEV)
    q_w, s_w = quantize_weight(w)
    for m in (1, 8, 9):
        x = torch.randn(m, 256, generator=g).to(DEV, torch.bfloat16)
        q_x, s_x = fp8.quantize_rows(x)
        want = fp8_decode_mm(q_x, s_x, q_w, s_w) if m <= 8 else scaled_mm_rows(q_x, s_x, q_w, s_w)
        assert torch.equal(fp8.fp8_linear(x, q_w, s_w), want)
        # rows with a scale per group of 128 columns: the decode GEMM takes them; past it, x is quantized per token
        q_g, s_g = quantize_rows_ref(x.reshape(m * 2, 128))
        grouped = fp8.attach_rows(x.clone(), q_g.reshape(m, 256), s_g.reshape(m, 2))
        want = fp8_decode_mm(q_g.reshape(m, 256), s_g.reshape(m, 2), q_w, s_w) if m <= 8 else want
        assert torch.equal(fp8.fp8_linear(grouped, q_w, s_w), want)
