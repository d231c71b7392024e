"""GPU only (compute capability >= 8.9): the fused FP8 quantization (the norms and SiLU-mul writing their
projection's FP8 input) in the engine with CUDA graphs gives what every projection quantizing itself
gives, and the fp8 suite's profile sees one quantization launch a layer instead of four."""

from __future__ import annotations

import csv

import pytest
import torch

from vlora_kernels import fp8 as fp8_kernels
from vlora_kernels import fp8_decode
from serve import Engine, EngineConfig, Request, SamplingParams
from serve.models import fp8 as fp8_models

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 tensor cores (compute capability >= 8.9)")]


def _generate(ckpt, fuse: bool, monkeypatch):
    monkeypatch.setattr(fp8_models, "FUSE_QUANTIZATION", fuse)
    engine = Engine(ckpt, EngineConfig(device="cuda", dtype="bfloat16", quantization="fp8", num_kv_blocks=256,
                                       cuda_graphs=True, graph_batch_sizes=(1, 2, 4), enable_prefix_cache=False))
    lm = engine.model.language_model
    assert all(layer.input_layernorm.fp8_output == fuse and layer.mlp.fp8_act == fuse for layer in lm.layers)
    params = SamplingParams(max_tokens=8, ignore_eos=True, keep_logits=True, detokenize=False)
    outs = engine.generate([Request(prompt=p, sampling=params) for p in ("a red car", "two dogs and a cat")])
    assert engine.stats().graph_steps > 0
    return outs


@pytest.mark.parametrize("decode_activations", ["fp8", "bf16"])  # bf16: the fusion in prefill steps only
def test_fused_quantization_gives_the_unfused_tokens_and_logits(tiny_zoo, monkeypatch, decode_activations):
    monkeypatch.setattr(fp8_kernels, "DECODE_ACTIVATIONS", decode_activations)
    ckpt = tiny_zoo["qwen2_vl_tiny"]
    fused, plain = _generate(ckpt, True, monkeypatch), _generate(ckpt, False, monkeypatch)
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logits, b.logits):  # the same FP8 bytes into the same GEMMs
            torch.testing.assert_close(x.float(), y.float(), atol=1e-3, rtol=1e-3)


def test_fp8_bench_profile_counts_one_quantization_launch_a_layer(vlora_home, tmp_path, monkeypatch):
    """With per-token FP8 activations at decode sizes (the default), the fusion's A/B."""
    from bench.fp8 import Fp8BenchJob, run_fp8_bench

    monkeypatch.setattr(fp8_kernels, "DECODE_ACTIVATIONS", "fp8")

    rows, meta = run_fp8_bench(Fp8BenchJob(model="qwen2_vl_tiny", device="cuda", prompts=2, prompt_tokens=16,
                                           image_size=56, output_tokens=4, batch_sizes=(1, 4), decode_tokens=3,
                                           switch_repeats=1, profile=True, profile_repeats=2, compare_unfused=True,
                                           out_dir=str(tmp_path)))
    layers = meta["layers"]
    out = next(tmp_path.iterdir())
    for name, own in (("fp8", layers), ("fp8_unfused", 4 * layers)):
        with open(out / f"profile_{name}_b4.csv", newline="") as f:
            calls = {}
            for k in csv.DictReader(f):
                calls[k["kernel"]] = calls.get(k["kernel"], 0) + float(k["calls"])
        quantize = sum(c for k, c in calls.items() if "_quantize_rows_kernel" in k)
        fused = sum(c for k, c in calls.items() if "_fp8_kernel" in k)
        # fused: the two norms' kernels and the SiLU-mul's two (its activation with the blocks' amaxes, then the cast)
        assert quantize == own and fused == (4 * layers if name == "fp8" else 0)
    assert all(r["fp8_gemm_us"] > 0 for r in rows if r["section"] == "gemm")
    acc = [r for r in rows if r["section"] == "accuracy" and r["against"] == "fp8"]
    assert acc and all(r["logit_max_abs_err"] < 1e-2 for r in acc)


def test_weight_only_decode_launches_no_quantization(vlora_home, tmp_path):
    """fp8_w8a16 (DECODE_ACTIVATIONS "bf16"): FP8 GEMMs on the bf16 activations as they are, so its decode step
    has no quantization launch and no fused producer writing FP8 rows; fp8 (per-token FP8 activations, the
    default) beside it has them."""
    from bench.fp8 import Fp8BenchJob, run_fp8_bench

    assert fp8_kernels.DECODE_ACTIVATIONS == "fp8"
    rows, meta = run_fp8_bench(Fp8BenchJob(model="qwen2_vl_tiny", device="cuda", prompts=2, prompt_tokens=16,
                                           image_size=56, output_tokens=4, batch_sizes=(4,), decode_tokens=3,
                                           switch_repeats=1, profile=True, profile_repeats=2, compare_w8a16=True,
                                           gemm=False, out_dir=str(tmp_path)))
    layers, out = meta["layers"], next(tmp_path.iterdir())
    assert meta["decode_activations"] == "fp8"
    for name, quantize_want, fused_want in (("fp8_w8a16", 0, 0), ("fp8", layers, 4 * layers)):
        with open(out / f"profile_{name}_b4.csv", newline="") as f:
            calls = {}
            for k in csv.DictReader(f):
                calls[k["kernel"]] = calls.get(k["kernel"], 0) + float(k["calls"])
        assert sum(c for k, c in calls.items() if "_quantize_rows_kernel" in k) == quantize_want, name
        assert sum(c for k, c in calls.items() if "_fp8_kernel" in k) == fused_want, name
        assert sum(c for k, c in calls.items() if "_fp8_decode_gemm_kernel" in k) == 4 * layers, name
    # the activations' rounding at decode is the only difference: no larger than FP8's own error against fp32
    acc = {(r["precision"], r["adapter"], r["mode"], r["against"]): r["logit_max_abs_err"] for r in rows
           if r["section"] == "accuracy"}
    pairs = [(err, acc["fp8", a, m, "fp32"]) for (p, a, m, against), err in acc.items()
             if p == "fp8_w8a16" and against == "fp8"]
    assert pairs and all(err <= 2 * own for err, own in pairs), pairs


def test_decode_gemms_behind_their_producers_give_the_bits_of_gemms_after_them(vlora_home, tmp_path):
    """GEMM_PDL (the default on Hopper): each decode GEMM launched with PDL behind the kernel that wrote its input,
    its weight prefetched while that kernel ends, in the engine's CUDA graphs; fp8_no_gemm_pdl launches them after.
    The same products in the same order: every logit equal, unmerged and merged."""
    from bench.fp8 import Fp8BenchJob, run_fp8_bench

    rows, meta = run_fp8_bench(Fp8BenchJob(model="qwen2_vl_tiny", device="cuda", prompts=2, prompt_tokens=16,
                                           image_size=56, output_tokens=4, batch_sizes=(4,), decode_tokens=3,
                                           switch_repeats=1, compare_gemm_pdl=True, gemm=False, out_dir=str(tmp_path)))
    assert meta["gemm_pdl"] is fp8_decode.GEMM_PDL
    acc = [r for r in rows if r["section"] == "accuracy" and r["precision"] == "fp8_no_gemm_pdl"
           and r["against"] == "fp8"]
    assert len(acc) == 3 and all(r["logit_max_abs_err"] == 0 and r["token_agreement"] == 1 for r in acc), acc
    assert {r["precision"] for r in rows if r["section"] == "decode"} == {"bf16", "fp8", "fp8_no_gemm_pdl"}


def test_decode_attention_writes_o_proj_rows_in_the_engine(vlora_home, tmp_path):
    """qwen2_vl_small: 2 heads of 64 a kv head group, one K tile of the decode GEMM, so at decode the attention
    writes o_proj's FP8 rows (one scale per kv head group) and no quantize_rows launch is left; fp8_no_attn_rows
    launches one a layer. Finer scales: its logits are no further from fp32's than one scale per token puts them."""
    from bench.fp8 import Fp8BenchJob, run_fp8_bench

    rows, meta = run_fp8_bench(Fp8BenchJob(model="qwen2_vl_small", device="cuda", prompts=2, prompt_tokens=16,
                                           image_size=56, output_tokens=4, batch_sizes=(4,), decode_tokens=3,
                                           switch_repeats=1, profile=True, profile_repeats=2,
                                           compare_attention_rows=True, gemm=False, out_dir=str(tmp_path)))
    layers, out = meta["layers"], next(tmp_path.iterdir())
    for name, quantize_want in (("fp8", 0), ("fp8_no_attn_rows", layers)):
        with open(out / f"profile_{name}_b4.csv", newline="") as f:
            calls = {}
            for k in csv.DictReader(f):
                calls[k["kernel"]] = calls.get(k["kernel"], 0) + float(k["calls"])
        assert sum(c for k, c in calls.items() if "_quantize_rows_kernel" in k) == quantize_want, name
    err = {(r["precision"], r["adapter"], r["mode"]): r["logit_mean_abs_err"] for r in rows
           if r["section"] == "accuracy" and r["against"] == "fp32"}
    pairs = [(e, err["fp8_no_attn_rows", a, m]) for (p, a, m), e in err.items() if p == "fp8"]
    assert len(pairs) == 3 and all(e <= 1.25 * other for e, other in pairs), pairs
