"""`vlora bench bench.suite=fp8` on the CPU with the tiny model: every section present, FP8's error above
bf16's, weights halved, switches restoring the exact FP8 bytes, the files."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from serve.models import fp8 as fp8_models
from vlora.commands.bench import run
from vlora.config import compose


def test_fp8_suite_on_cpu(vlora_home, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only waits (see tests/adapter_cases.py)
    try:
        cfg = compose("bench", ["bench.suite=fp8", "bench.fp8.device=cpu", "bench.fp8.model=qwen2_vl_tiny",
                                "bench.fp8.image_size=56", "bench.fp8.prompts=3", "bench.fp8.prompt_tokens=16",
                                "bench.fp8.output_tokens=6", "bench.fp8.batch_sizes=[1,2]",
                                "bench.fp8.decode_tokens=3", "bench.fp8.switch_repeats=2", "bench.fp8.profile=true",
                                "bench.fp8.profile_repeats=1", "bench.fp8.compare_unfused=true", f"bench.out_dir={tmp_path}"])
        result = run(cfg)
    finally:
        torch.set_num_threads(threads)
    rows, meta = result["fp8"], result["meta"]
    assert fp8_models.ALLOW_CPU is False  # let through for the run only
    acc = {(r["precision"], r["adapter"], r["mode"], r["against"]): r for r in rows if r["section"] == "accuracy"}
    cases = (("none", "unmerged"), ("a", "unmerged"), ("a", "merged"))
    assert set(acc) == {(p, a, m, "fp32") for p in ("bf16", "fp8", "fp8_unfused") for a, m in cases} | {
        ("bf16", "a", "merged", "bf16 unmerged"), ("fp8", "a", "merged", "fp8 unmerged"),
        ("fp8_unfused", "a", "merged", "fp8_unfused unmerged")} | {("fp8_unfused", a, m, "fp8") for a, m in cases}
    for adapter, mode in cases:  # the fused quantization's A/B: the same numbers
        assert acc["fp8_unfused", adapter, mode, "fp8"]["logit_max_abs_err"] == 0
    for adapter, mode in (("none", "unmerged"), ("a", "unmerged"), ("a", "merged")):
        bf16, fp8 = acc["bf16", adapter, mode, "fp32"], acc["fp8", adapter, mode, "fp32"]
        assert 0 < bf16["logit_max_abs_err"] < fp8["logit_max_abs_err"]  # 3 mantissa bits against 8
        assert fp8["logit_rel_err"] < 0.25 and 0 <= fp8["token_agreement"] <= 1
    decode = [(r["precision"], r["batch"]) for r in rows if r["section"] == "decode"]
    assert decode == [(p, b) for p in ("bf16", "fp8", "fp8_unfused") for b in (1, 2)]
    assert all(r["decode_wall_ms"] > 0 for r in rows if r["section"] == "decode")
    switch = {r["precision"]: r for r in rows if r["section"] == "switch"}
    assert switch["fp8"]["restore_exact"] is True and switch["fp8"]["method"] == "requantize:addmm"
    assert switch["fp8"]["merge_ms"] > 0 and switch["bf16"]["switch_ms"] > 0
    # FP8 projections: one byte a weight plus a fp32 scale a row (and bf16 biases), about half of bf16
    assert 0.5 < switch["fp8"]["projection_bytes"] / switch["bf16"]["projection_bytes"] < 0.53
    assert switch["fp8"]["merge_saved_bytes"] > 0 and switch["bf16"]["merge_saved_bytes"] == 0
    # the profile: one engine decode step per precision and batch, after the timings; every FP8 projection's
    # quantization and GEMM is in it (4 projections a layer), bf16 has neither quantization nor _scaled_mm
    layers = 4  # qwen2_vl_tiny
    prof = {(r["precision"], r["batch"]): r for r in rows if r["section"] == "profile"}
    assert list(prof) == decode
    for (name, b), r in prof.items():
        assert r["step"] == "engine step" and 0 < r["busy_us"] <= r["span_us"] and r["gemm_us"] > 0
        # the CPU's PyTorch norms fuse nothing: every FP8 projection quantizes its input
        assert r["quantize_calls"] == (0 if name == "bf16" else 4 * layers)
        with open(tmp_path / "cpu" / f"profile_{name}_b{b}.csv", newline="") as f:
            kernels = list(csv.DictReader(f))
        assert list(kernels[0]) == ["kernel", "kind", "calls", "total_us", "share"]
        names = {k["kernel"]: k for k in kernels}
        # on the CPU fp8_linear multiplies the dequantized operands, under this name (_scaled_mm on a GPU)
        assert ("fp8_scaled_mm" in names) == (name != "bf16")
        if name != "bf16":
            assert float(names["fp8_scaled_mm"]["calls"]) == 4 * layers
            assert names["fp8_scaled_mm"]["kind"] == "gemm" and names["fp8_quantize_rows"]["kind"] == "quantize"
        assert sum(float(k["total_us"]) for k in kernels) == pytest.approx(r["busy_us"])
    # the projection GEMMs alone: every shape of the model at every batch size, every timing (the Triton
    # decode GEMM through the interpreter here)
    gemm = {(r["projection"], r["m"]): r for r in rows if r["section"] == "gemm"}
    assert set(gemm) == {(p, m) for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") for m in (1, 2)}
    assert all(r[c] > 0 for r in gemm.values() for c in ("bf16_us", "fp8_us", "fp8_gemm_us", "plain_us", "swap_us",
                                                          "triton_us", "w8a16_us", "quantize_us", "triton_tb_s",
                                                          "w8a16_tb_s"))
    assert gemm["down_proj", 1]["k"] == gemm["gate_up_proj", 1]["n"] // 2
    out = tmp_path / "cpu"
    with open(out / "fp8.csv", newline="") as f:
        assert {r["section"] for r in csv.DictReader(f)} == {"accuracy", "decode", "switch", "profile", "gemm"}
    assert json.loads((out / "fp8.json").read_text())["meta"]["job"]["model"] == "qwen2_vl_tiny"
    md = (out / "fp8.md").read_text()
    assert "## Accuracy" in md and "fp8 switch / bf16 switch" in md and "## Decode step profile" in md
    assert "## Projection GEMMs alone" in md and "the 4 layers' projections take" in md


@pytest.mark.parametrize("m", [1, 7, 16, 33])
def test_the_transposed_gemm_gives_the_product_as_written(m):
    # the swap_us column's GEMM: padded token rows, swapped scales, transposed back. On the CPU, where the torch
    # release takes rowwise-scaled _scaled_mm at all.
    from bench.fp8_gemm import transposed_scaled_mm
    from vlora_kernels.fp8 import dequantize, quantize_rows_ref, quantize_weight, scaled_mm_rows

    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 64, generator=g)
    x[0] *= 50.0  # one token's scale far from the others': a scale on the wrong axis shows
    q_w, s_w = quantize_weight(torch.randn(48, 64, generator=g) * torch.linspace(0.1, 4.0, 48)[:, None])
    q_x, s_x = quantize_rows_ref(x)
    try:
        plain = scaled_mm_rows(q_x, s_x, q_w, s_w)
    except RuntimeError as e:
        pytest.skip(f"this torch's CPU _scaled_mm takes no rowwise scales: {str(e)[:80]}")
    swapped = transposed_scaled_mm(q_x, s_x, q_w, s_w)
    assert swapped.shape == (m, 48) and swapped.is_contiguous()
    assert torch.equal(swapped, plain)
    ref = dequantize(q_x, s_x.squeeze(1)) @ dequantize(q_w, s_w).T
    torch.testing.assert_close(swapped.float(), ref, atol=2.0 ** -8 * ref.abs().max().item(), rtol=2.0 ** -8)
