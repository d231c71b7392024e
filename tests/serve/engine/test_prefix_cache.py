"""Prefix reuse (KV blocks shared by image hash + prompt prefix) and the encoder-output cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from serve_cases import frames, image, make_request

from serve import Engine, EngineConfig

LONG = ("Look at the picture taken at the crossing this morning and answer carefully, "
        "counting every vehicle you can see: ")


def _engine(path, **kw):
    return Engine(path, EngineConfig(device="cpu", num_kv_blocks=96, kv_block_size=8, **kw))


def _same(a, b):
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen2_5_vl_tiny", "llava_1_5_tiny"])
def test_a_shared_image_and_prompt_prefix_reuse_blocks_with_unchanged_outputs(name, tiny_zoo):
    first = dict(prompt=LONG + "how many cars?", images=[image(0)])
    second = dict(prompt=LONG + "how many buses are parked?", images=[image(0)])
    other_image = dict(prompt=LONG + "how many buses are parked?", images=[image(9)])
    cached, plain = _engine(tiny_zoo[name]), _engine(tiny_zoo[name], enable_prefix_cache=False)
    outs = []
    for spec in (first, second, other_image):  # one after the other
        outs.append(cached.generate(make_request(spec)))
        _same(outs[-1], plain.generate(make_request(spec)))
    # the second request finds the first's blocks through the image and the shared text
    prompt = cached.processor.process(second["prompt"], images=second["images"])
    image_end = prompt.vision[0].offset + prompt.vision[0].num_tokens
    assert outs[1].metrics.num_cached_tokens >= image_end
    # another picture: only blocks before its placeholders can be shared
    assert outs[2].metrics.num_cached_tokens <= prompt.vision[0].offset
    assert plain.stats().prefix_hit_tokens == 0 and cached.stats().prefix_hit_tokens > 0
    assert cached.stats().blocks_in_use == 0


def test_requests_in_flight_together_share_only_computed_blocks(tiny_zoo):
    spec = dict(prompt=LONG + "how many cars?", images=[image(0)])
    engine, plain = _engine(tiny_zoo["qwen2_vl_tiny"], max_tokens_per_step=40), _engine(tiny_zoo["qwen2_vl_tiny"])
    want = plain.generate(make_request(spec))
    first = engine.add_request(make_request(spec))
    engine.step()  # the first prompt's first chunk is computed; a twin arrives
    second = engine.add_request(make_request(spec))
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    _same(final[first], want)
    _same(final[second], want)
    assert final[second].metrics.num_cached_tokens > 0


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "llava_1_5_tiny"])
def test_a_repeated_image_is_encoded_once_with_unchanged_outputs(name, tiny_zoo):
    specs = [dict(prompt="How many cars?", images=[image(3)]), dict(prompt="Any trucks?", images=[image(3)]),
             dict(prompt="Both?", images=[image(3), image(4)])]
    cached = _engine(tiny_zoo[name], enable_prefix_cache=False)
    uncached = _engine(tiny_zoo[name], enable_prefix_cache=False, encoder_cache_items=0)
    for spec in specs:
        _same(cached.generate(make_request(spec)), uncached.generate(make_request(spec)))
    assert cached.stats().items_encoded == 2 and cached.stats().encoder_cache_hits == 2
    assert uncached.stats().items_encoded == 4
    # in one step, a repeated image goes through the tower once even without the cache
    batch_engine = _engine(tiny_zoo[name], enable_prefix_cache=False, encoder_cache_items=0)
    batch = batch_engine.generate([make_request(s) for s in specs])
    assert batch_engine.stats().items_encoded == 2 and batch_engine.stats().encoder_calls == 1
    for a, spec in zip(batch, specs):
        _same(a, uncached.generate(make_request(spec)))


def test_drop_caches_makes_a_repeat_compute_everything_again(tiny_zoo):
    """What the serving evaluation does between policies: the same request again finds no K/V
    blocks and no vision embeddings, and gives the same output."""
    spec = dict(prompt=LONG + "how many cars?", images=[image(0)])
    engine = _engine(tiny_zoo["qwen2_vl_tiny"])
    first = engine.generate(make_request(spec))
    cached = engine.generate(make_request(spec))
    assert cached.metrics.num_cached_tokens > 0 and len(engine.runner.encoder_cache) == 1
    dropped = engine.drop_caches()
    assert dropped["prefix_blocks"] > 0 and dropped["encoder_items"] == 1
    hits, calls = engine.stats().prefix_hit_tokens, engine.runner.counters["encoder_calls"]
    again = engine.generate(make_request(spec))
    assert again.metrics.num_cached_tokens == 0 and engine.stats().prefix_hit_tokens == hits
    assert engine.runner.counters["encoder_calls"] == calls + 1
    _same(again, first)
    assert engine.stats().blocks_in_use == 0


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "qwen2_5_vl_tiny"])
def test_repeated_frame_groups_of_video_skip_the_tower(name, tiny_zoo):
    # a static camera: the next chunk repeats two of the last chunk's frame groups (temporal
    # patches of 2 frames); only the new group goes through the vision tower, with the outputs of an
    # engine without the encoder cache (the parity tests check those against transformers, which
    # encodes each clip whole)
    a, b, c, d = (frames(s, n=2) for s in (11, 12, 13, 14))
    first, second = np.concatenate([a, b, c]), np.concatenate([b, c, d])
    cached = _engine(tiny_zoo[name], enable_prefix_cache=False)
    uncached = _engine(tiny_zoo[name], enable_prefix_cache=False, encoder_cache_items=0)
    for clip in (first, second):
        spec = dict(prompt="Which way?", video=clip)
        _same(cached.generate(make_request(spec)), uncached.generate(make_request(spec)))
    assert cached.stats().items_encoded == 4 and cached.stats().encoder_cache_hits == 2
    assert uncached.stats().items_encoded == 6
