"""engine.warm_up_sizes: cameras that are not square find their tower shapes warmed (the attention plans
recorded for the serving thread), which the square warm-up alone does not give them."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from serve import Engine, EngineConfig
from serve.engine import Request
from serve.forward import segment_plans

NAME = "qwen2_vl_tiny"
WIDE = (168, 56)  # a 3:1 camera, (width, height)


def _engine(tiny_zoo, **extra) -> Engine:
    return Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=96, max_batch_size=2, adapter_slots=0,
                                               max_vision_batch=4, warm_up="on", warm_up_side=56, warm_up_frames=2,
                                               **extra))


def _on_a_thread(fn):
    box = {}

    def run():
        segment_plans.forget()
        try:
            box["value"] = fn()
        finally:
            segment_plans.forget()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return box["value"]


def _warmed(engine) -> set:
    """The shapes a warm-up records on its thread."""
    def run():
        engine.warm_up()
        return set(segment_plans._state()["known"])
    return _on_a_thread(run)


def _live(engine, count: int) -> set:
    """The tower shapes of `count` chunks of the wide camera in one tower call, as a live step meets them."""
    clip = np.random.default_rng(1).integers(0, 256, (2, WIDE[1], WIDE[0], 3), dtype=np.uint8)

    def run():
        items = []
        for _ in range(count):
            prompt, _, _ = engine.prepare(Request(prompt="How many cars?", video=clip))
            items.extend(prompt.vision)
        with segment_plans.recording():
            engine.model.encode(items)
        return set(segment_plans._state()["known"])
    return _on_a_thread(run)


def test_a_wide_camera_finds_its_tower_shapes_warmed_only_when_its_size_is_given(tiny_zoo):
    with_size = _engine(tiny_zoo, warm_up_sizes=[list(WIDE)])
    assert with_size.config.warm_up_sizes == (WIDE,)
    warmed = _warmed(with_size)
    plain = _warmed(_engine(tiny_zoo))
    for count in (1, 3):
        live = _live(with_size, count)
        assert live and live <= warmed, sorted(k[:2] for k in live - warmed)
        assert not live <= plain  # the square warm-up never ran a wide frame's length
    assert plain < warmed


def test_warm_up_sizes_refuse_what_is_not_a_picture_size():
    assert EngineConfig(warm_up_sizes=["1280x720", (640, 480)]).warm_up_sizes == ((1280, 720), (640, 480))
    for bad in (["1280"], [(20, 720)], [3], [(1, 2, 3)]):
        with pytest.raises(ValueError, match="warm_up_sizes"):
            EngineConfig(warm_up_sizes=bad)
