"""An engine over a checkpoint that already holds FP8 projections (fbgemm_fp8 layout, tiny Qwen2-VL, bf16,
FP8 let through on the CPU by `serve.models.fp8.ALLOW_CPU`) against the engine that quantizes the same
model's bf16 weights itself: the same bytes, so the same greedy tokens and logits, bit for bit, with
an adapter's LoRA branch unmerged, merged into the FP8 weights, and after unmerging them again."""

from __future__ import annotations

import pytest
import torch
from adapter_cases import make_classifier_adapter, one_thread  # noqa: F401 (autouse: one intra-op thread)
from fp8_checkpoints import write_fp8_checkpoint
from serve_cases import case_specs, make_request

from serve import Engine, EngineConfig
from serve.models import fp8 as fp8_module
from serve.orchestrator import Mode

MAX_NEW = 4


@pytest.fixture(scope="module")
def engines(tiny_zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_ckpt_engine")
    src = tiny_zoo["qwen2_vl_tiny"]
    adapter = make_classifier_adapter(src, root / "cls")
    stored = write_fp8_checkpoint(src, root / "fbgemm", "fbgemm_fp8")
    fp8_module.ALLOW_CPU = True  # module scope: monkeypatch is function-scoped
    try:
        return [Engine(path, EngineConfig(device="cpu", dtype="bfloat16", quantization="fp8", num_kv_blocks=64,
                                          enable_prefix_cache=False, adapter_slots=2, max_lora_rank=8,
                                          adapters=(f"cls={adapter}",)))
                for path in (stored, src)]
    finally:
        fp8_module.ALLOW_CPU = False


def _generate(engine, adapters=(None, "cls")) -> list:
    reqs = []
    for adapter in adapters:  # unmerged: base and adapter requests in one batch; merged: the merged adapter's
        for spec in case_specs("qwen2_vl")[:2]:
            r = make_request(spec, MAX_NEW, ignore_eos=True)
            r.adapter = adapter
            reqs.append(r)
    return engine.generate(reqs)


def _weights(engine) -> list[torch.Tensor]:
    return [t.detach().clone() for _, _, m in engine.model.language_model.projections()
            for t in (m.base.weight.view(torch.uint8), m.base.weight_scale)]


def _same_outputs(a: list, b: list) -> None:
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert all(torch.equal(p, q) for p, q in zip(x.logits, y.logits))


def test_stored_fp8_serves_bit_for_bit_as_our_own_quantization_in_every_mode(engines):
    stored, ours = engines
    before = _weights(stored)
    assert all(torch.equal(p, q) for p, q in zip(before, _weights(ours)))
    _same_outputs(_generate(stored), _generate(ours))  # unmerged: the LoRA branch over the FP8 GEMM
    for engine in engines:
        engine.set_mode(Mode.merge("cls"))
    merged = _weights(stored)
    assert not all(torch.equal(p, q) for p, q in zip(before, merged))  # the merge requantized
    assert all(torch.equal(p, q) for p, q in zip(merged, _weights(ours)))
    _same_outputs(_generate(stored, ["cls"]), _generate(ours, ["cls"]))
    for engine in engines:
        engine.set_mode(Mode.unmerge())
    assert all(torch.equal(p, q) for p, q in zip(before, _weights(stored)))  # the checkpoint's bytes again
    _same_outputs(_generate(stored), _generate(ours))
