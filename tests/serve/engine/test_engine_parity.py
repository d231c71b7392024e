"""Greedy tokens and logits of the engine against Hugging Face transformers (fp32, tiny zoo), for
a mixed batch arriving together, staggered with chunked prefill, and under forced preemption."""

from __future__ import annotations

import pytest
from serve_cases import assert_matches_hf, case_specs, hf_generate, make_request, staggered

from serve import Engine, EngineConfig

ARCHS = {"qwen2_vl_tiny": "qwen2_vl", "qwen2_5_vl_tiny": "qwen2_5_vl", "llava_1_5_tiny": "llava"}
_REFERENCES: dict[str, list] = {}


def _references(name, path):
    if name not in _REFERENCES:
        _REFERENCES[name] = [hf_generate(path, spec) for spec in case_specs(ARCHS[name])]
    return _REFERENCES[name]


@pytest.mark.parametrize("name", list(ARCHS))
def test_a_batch_arriving_together_matches_transformers(name, tiny_zoo):
    engine = Engine(tiny_zoo[name], EngineConfig(device="cpu", num_kv_blocks=64))
    outputs = engine.generate([make_request(s) for s in case_specs(ARCHS[name])])
    assert_matches_hf(outputs, _references(name, tiny_zoo[name]))
    stats = engine.stats()
    assert stats.blocks_in_use == 0 and stats.waiting == stats.running == 0  # nothing leaked
    assert stats.encoder_calls == 1  # every image and clip of the batch went through the tower together


@pytest.mark.parametrize("name", list(ARCHS))
def test_staggered_arrivals_with_chunked_prefill_match_transformers(name, tiny_zoo):
    # a 24-token budget splits every prompt (and some image spans) over several steps
    engine = Engine(tiny_zoo[name], EngineConfig(device="cpu", num_kv_blocks=64, kv_block_size=8,
                                                 max_tokens_per_step=24))
    assert_matches_hf(staggered(engine, case_specs(ARCHS[name])), _references(name, tiny_zoo[name]))
    assert engine.stats().blocks_in_use == 0


@pytest.mark.parametrize("name", list(ARCHS))
def test_forced_preemption_keeps_the_outputs(name, tiny_zoo):
    specs = case_specs(ARCHS[name])
    probe = Engine(tiny_zoo[name], EngineConfig(device="cpu", num_kv_blocks=8))
    lengths = [len(probe.processor.process(s["prompt"], None, s.get("images", []), s.get("video")).token_ids)
               for s in specs]
    # every prompt is admitted at once, then there is one spare block for all of their growth
    blocks = max(sum(-(-n // 4) for n in lengths) + 1, -(-(max(lengths) + 6) // 4))
    engine = Engine(tiny_zoo[name], EngineConfig(device="cpu", num_kv_blocks=blocks, kv_block_size=4,
                                                 enable_prefix_cache=False))
    outputs = engine.generate([make_request(s) for s in specs])
    stats = engine.stats()
    assert stats.num_preemptions > 0 and any(o.metrics.num_preemptions for o in outputs)
    assert_matches_hf(outputs, _references(name, tiny_zoo[name]))
    assert stats.blocks_in_use == 0
