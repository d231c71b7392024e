"""GPU only (Hopper: PDL): the decoder's kernels launched as a PDL chain (vlora_kernels/interpreter.py `pdl_chained`:
each norm, RoPE with the cache writes, SiLU-mul and decode attention launched while the kernel before it runs and
waiting for it on the device) compute the bits they compute launched one after another. In the engine with CUDA
graphs, bf16 and FP8, with and without an adapter, generated tokens and head answers: every logit equal."""

from __future__ import annotations

import pytest
import torch
from adapter_cases import make_classifier_adapter
from serve_cases import case_specs, make_request

from vlora_kernels import interpreter
from serve import Engine, EngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs a GPU with programmatic dependent launch (Hopper or newer)")]


@pytest.fixture(scope="module")
def adapter(tiny_zoo, tmp_path_factory):
    return make_classifier_adapter(tiny_zoo["qwen2_vl_tiny"], tmp_path_factory.mktemp("pdl_chain") / "cls")


def _outputs(ckpt, adapter, quantization: str, chain: bool, monkeypatch):
    monkeypatch.setattr(interpreter, "PDL_CHAIN", chain)
    assert interpreter.pdl_chained(torch.device("cuda")) is chain
    engine = Engine(ckpt, EngineConfig(device="cuda", dtype="bfloat16", quantization=quantization, num_kv_blocks=256,
                                       cuda_graphs=True, graph_batch_sizes=(1, 2, 4, 8), enable_prefix_cache=False,
                                       adapter_slots=2, max_lora_rank=8))
    engine.load_adapter("cls", adapter)
    requests = []
    for i, spec in enumerate(case_specs("qwen2_vl")):
        r = make_request(spec, 8, ignore_eos=True)
        r.adapter = "cls" if i % 2 else None
        h = make_request(spec)
        h.adapter, h.output_mode = "cls", "head"
        requests += [r, h]
    outs = engine.generate(requests)
    assert engine.stats().graph_steps > 0
    del engine
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_the_pdl_chain_gives_the_bits_of_kernels_launched_one_after_another(tiny_zoo, adapter, quantization,
                                                                            monkeypatch):
    ckpt = tiny_zoo["qwen2_vl_tiny"]
    chained = _outputs(ckpt, adapter, quantization, True, monkeypatch)
    plain = _outputs(ckpt, adapter, quantization, False, monkeypatch)
    for a, b in zip(chained, plain):
        if b.head is not None:
            assert a.head.label == b.head.label and a.head.confidence == b.head.confidence
            continue
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logits, b.logits):
            assert torch.equal(x, y)


def test_with_split_k_the_chain_gives_the_fp8_logits_of_kernels_launched_one_after_another(tmp_path, monkeypatch):
    """qwen2_vl_small splits K in down_proj's decode GEMM, so a reduction follows it and reads the activation's
    scales, written two kernels before it (the tiny model has no split). At the 7B shape, reading them before the
    reduction's wait changed FP8's logits without an adapter; here every logit error against fp32 must be equal."""
    from bench.fp8 import Fp8BenchJob, run_fp8_bench
    from vlora_kernels import fp8_decode

    assert fp8_decode.decode_config(512, 2048)[2] > 1  # down_proj's [hidden, intermediate] weight: split over K
    errors = {}
    for chain in (True, False):
        monkeypatch.setattr(interpreter, "PDL_CHAIN", chain)
        rows, _ = run_fp8_bench(Fp8BenchJob(model="qwen2_vl_small", device="cuda", prompts=2, prompt_tokens=16,
                                            image_size=56, output_tokens=6, batch_sizes=(4,), decode_tokens=3,
                                            switch_repeats=1, gemm=False, out_dir=str(tmp_path / str(chain))))
        errors[chain] = {(r["precision"], r["adapter"], r["mode"]): (r["logit_mean_abs_err"], r["token_agreement"])
                         for r in rows if r["section"] == "accuracy" and r["against"] == "fp32"}
    assert errors[True] == errors[False] and any(p == "fp8" for p, _, _ in errors[True])
