"""The engine with quantization=fp8 end to end on the CPU (tiny Qwen2-VL, bf16; FP8 let through by the
test-only `serve.models.fp8.ALLOW_CPU`): greedy tokens mostly agree with the bf16 engine's, task-head
answers agree, and an adapter's LoRA branch is added over the FP8 base (unmerged)."""

from __future__ import annotations

import pytest
import torch
from adapter_cases import make_classifier_adapter, one_thread  # noqa: F401 (autouse: one intra-op thread)
from serve_cases import case_specs, make_request

from serve import Engine, EngineConfig
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
