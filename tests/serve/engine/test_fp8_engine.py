"""The engine with quantization=fp8 end to end on the CPU (tiny Qwen2-VL, bf16; FP8 let through by the
test-only `serve.models.fp8.ALLOW_CPU`): greedy tokens mostly agree with the bf16 engine's, task-head
answers agree, and an adapter's LoRA branch is added over the FP8 base (unmerged)."""

from __future__ import annotations

import pytest
import torch
from adapter_cases import make_classifier_adapter, one_thread  # noqa: F401 (autouse: one intra-op thread)
from serve_cases import case_specs, make_request

from serve import Engine, EngineConfig, Request, SamplingParams
from serve.models import fp8 as fp8_module
from serve.models.fp8 import Fp8Linear

MAX_NEW = 8


@pytest.fixture(scope="module")
def adapter(tiny_zoo, tmp_path_factory):
    return make_classifier_adapter(tiny_zoo["qwen2_vl_tiny"], tmp_path_factory.mktemp("fp8_adapter") / "cls")


def _run(ckpt, adapter, quantization: str) -> tuple[Engine, list, list]:
    engine = Engine(ckpt, EngineConfig(device="cpu", dtype="bfloat16", quantization=quantization, num_kv_blocks=96,
                                       enable_prefix_cache=False, adapter_slots=2, max_lora_rank=8))
    engine.load_adapter("cls", adapter)
    specs = case_specs("qwen2_vl")
    gen = []
    for i, spec in enumerate(specs):
        r = make_request(spec, MAX_NEW, ignore_eos=True)
        r.adapter = "cls" if i % 2 else None
        gen.append(r)
    heads = []
    for spec in specs:
        r = make_request(spec)
        r.adapter, r.output_mode = "cls", "head"
        heads.append(r)
    outs = engine.generate(gen + heads)
    return engine, outs[:len(gen)], outs[len(gen):]


def test_fp8_engine_tokens_mostly_agree_with_bf16_and_heads_agree(tiny_zoo, adapter, monkeypatch):
    ckpt = tiny_zoo["qwen2_vl_tiny"]
    _, ref_gen, ref_heads = _run(ckpt, adapter, "none")
    monkeypatch.setattr(fp8_module, "ALLOW_CPU", True)
    engine, gen, heads = _run(ckpt, adapter, "fp8")
    bases = [m.base for _, _, m in engine.model.language_model.projections()]
    assert bases and all(isinstance(b, Fp8Linear) for b in bases)  # LoRA wraps the FP8 layers
    same = sum(a == b for r, o in zip(ref_gen, gen) for a, b in zip(r.token_ids, o.token_ids))
    total = sum(len(r.token_ids) for r in ref_gen)
    assert total == MAX_NEW * len(ref_gen) and same >= 0.75 * total, (same, total)  # measured 27 of 32
    first = [o.logits[0].float() for o in gen]  # the first token's logits: same prompt on both sides
    for r, o in zip(ref_gen, first):
        ref = r.logits[0].float()
        assert (o - ref).abs().max() < 0.1 * ref.abs().max()
    for r, o in zip(ref_heads, heads):
        assert o.head.label == r.head.label
        assert abs(o.head.confidence - r.head.confidence) < 0.03  # measured <= 0.011


def test_an_fp8_lm_head_gives_the_logits_of_its_fp8_copy(tiny_zoo, monkeypatch):
    """fp8_lm_head: the logits of every step come from the head quantized per vocabulary row (fp8_linear), close to
    the bf16 head's; refused without quantization=fp8."""
    from vlora_kernels.fp8 import FP8_DTYPE, dequantize, fp8_linear

    with pytest.raises(ValueError, match="fp8_lm_head=true needs quantization=fp8, got quantization=none"):
        EngineConfig(device="cpu", fp8_lm_head=True)
    monkeypatch.setattr(fp8_module, "ALLOW_CPU", True)
    engines = {head: Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(
        device="cpu", dtype="bfloat16", quantization="fp8", fp8_lm_head=head, num_kv_blocks=32,
        enable_prefix_cache=False, adapter_slots=0)) for head in (False, True)}
    plain, quantized = (engines[h].model.language_model for h in (False, True))
    assert plain.lm_head_fp8 is None and quantized.lm_head_fp8.dtype == FP8_DTYPE
    weight = quantized.head_weight()
    assert quantized.lm_head_fp8.shape == weight.shape  # the bf16 head is kept beside it
    hidden = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = quantized.compute_logits(hidden)
    assert torch.equal(got, fp8_linear(hidden, quantized.lm_head_fp8, quantized.lm_head_scale))
    want = plain.compute_logits(hidden).float()
    assert not torch.equal(got.float(), want) and (got.float() - want).abs().max() < 0.1 * want.abs().max()
    # the copy is the head's own weight, rounded per row
    back = dequantize(quantized.lm_head_fp8, quantized.lm_head_scale)
    assert ((back - weight.float()).abs() <= weight.float().abs().amax(-1, keepdim=True) / 16).all()
    params = SamplingParams(max_tokens=4, ignore_eos=True, keep_logits=True, detokenize=False)
    outs = {h: e.generate([Request(prompt="a red car", sampling=params)])[0] for h, e in engines.items()}
    first = [outs[h].logits[0].float() for h in (False, True)]
    assert (first[1] - first[0]).abs().max() < 0.1 * first[0].abs().max()
