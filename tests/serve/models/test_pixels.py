"""Device-side Qwen pixels: our resize / normalise / patchify and the deferred prompt path against
the checkpoint's processor, with inputs as users send them (odd sizes, odd frame counts, JPEG)."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from serve.models import load_model
from serve.models.deferred import materialize
from serve.models.pixels import QwenPixelSpec, qwen_pixels, smart_resize
from serve.rpc.wire import encode_frame

QWEN = ["qwen2_vl_tiny", "qwen2_5_vl_tiny"]


def _noise(seed, *shape):
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def _jpeg(frame: np.ndarray) -> bytes:
    return encode_frame(frame, "jpeg")[1]


@pytest.fixture(scope="module")
def processors(tiny_zoo):
    return {name: (load_model(tiny_zoo[name], pixels="host")[1], load_model(tiny_zoo[name], pixels="device")[1])
            for name in QWEN}


@pytest.mark.parametrize("shape", [(4, 56, 56), (5, 60, 90), (3, 333, 500), (1, 41, 203)])
def test_pixels_equal_the_video_processor(processors, shape):
    host, _ = processors["qwen2_vl_tiny"]
    spec = QwenPixelSpec.from_processor(host.processor)
    frames = _noise(sum(shape), *shape)
    want = host.processor.video_processor(videos=[frames], return_tensors="pt")
    size = spec.video_size(*shape)
    assert list(spec.grid(shape[0], size)) == want["video_grid_thw"][0].tolist()
    got = qwen_pixels(torch.from_numpy(frames)[None], size, spec)[0]
    torch.testing.assert_close(got, want["pixel_values_videos"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("shape", [(100, 150), (56, 56), (29, 400)])
def test_pixels_equal_the_image_processor(processors, shape):
    host, _ = processors["qwen2_5_vl_tiny"]
    spec = QwenPixelSpec.from_processor(host.processor)
    image = _noise(shape[0], *shape)
    want = host.processor.image_processor(images=[Image.fromarray(image)], return_tensors="pt")
    got = qwen_pixels(torch.from_numpy(image)[None, None], spec.image_size(*shape), spec)[0]
    torch.testing.assert_close(got, want["pixel_values"], atol=1e-6, rtol=0)


def test_smart_resize_bounds():
    assert smart_resize(448, 448, 28, 3136, 1003520) == (448, 448)
    assert smart_resize(10, 10, 28, 3136, 1003520) == (56, 56)  # up to the minimum
    h, w = smart_resize(4000, 3000, 28, 3136, 1003520)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 1003520
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 4000, 28, 3136, 1003520)


def _clip_inputs(seed):
    clip = _noise(seed, 5, 60, 90)  # odd frame count: the last group is padded
    return {"array": clip, "jpeg": [_jpeg(f) for f in clip], "frames": list(clip)}


@pytest.mark.parametrize("name", QWEN)
@pytest.mark.parametrize("form", ["array", "jpeg", "frames"])
def test_deferred_prompt_equals_the_processor(processors, name, form):
    host, device = processors[name]
    assert device.pixel_spec is not None
    image = _noise(7, 100, 150)
    png = io.BytesIO()
    Image.fromarray(_noise(8, 41, 67)).save(png, format="PNG")
    images = [image, png.getvalue(), Image.fromarray(_noise(9, 70, 50))]
    video = _clip_inputs(3)[form]
    want = host.process("Which way do the cars go?", images=images, video=video)
    got = device.process("Which way do the cars go?", images=images, video=video)
    assert got.token_ids == want.token_ids
    assert [(v.kind, v.grid_thw, v.offset, v.num_tokens) for v in got.vision] == \
           [(v.kind, v.grid_thw, v.offset, v.num_tokens) for v in want.vision]
    for g, w in zip(got.vision, want.vision):
        assert g.pixel_values is None and g.deferred is not None
        assert g.second_per_grid_t == pytest.approx(w.second_per_grid_t)
    rows = materialize([v.deferred for v in got.vision], "cpu", torch.float32)
    for r, w in zip(rows, want.vision):
        torch.testing.assert_close(r, w.pixel_values, atol=1e-6, rtol=0)
    if form != "jpeg":  # raw frames hash as the host path does: the caches are shared
        assert [v.content_hash for v in got.vision] == [v.content_hash for v in want.vision]


def test_jpeg_clips_stay_encoded_and_repeated_groups_share_keys(processors):
    host, device = processors["qwen2_vl_tiny"]
    still = _jpeg(_noise(1, 56, 56))
    moving = [_jpeg(f) for f in _noise(2, 2, 56, 56)]
    item = device.process("Any cars?", video=moving + [still] * 4).vision[0]
    assert item.deferred.encoded and len(item.group_hashes) == 3
    assert item.group_hashes[1] == item.group_hashes[2] != item.group_hashes[0]
    # frames of two sizes, or bytes that are no image: refused on the host, as the host path does
    for bad in ([still, _jpeg(_noise(1, 60, 56))], [still, b"not an image"]):
        with pytest.raises(Exception) as want:
            host.process("Any cars?", video=bad)
        with pytest.raises(type(want.value)):
            device.process("Any cars?", video=bad)


def test_a_processor_the_device_path_does_not_reproduce_keeps_the_host_path(tiny_zoo, caplog):
    from serve.models.processing import PromptProcessor

    host = load_model(tiny_zoo["qwen2_vl_tiny"], pixels="host")[1]
    host.processor.video_processor.merge_size = 1  # grids and rows no longer follow the spec's merge
    with caplog.at_level(logging.WARNING):
        pp = PromptProcessor(host.processor, host.args, pixels="device")
    assert pp.pixel_spec is None and "device pixel preprocessing is off" in caplog.text
    with pytest.raises(ValueError, match="pixels must be"):
        PromptProcessor(host.processor, host.args, pixels="gpu")


def test_engine_answers_alike_with_device_pixels(tiny_zoo):
    from serve import Engine, EngineConfig, Request, SamplingParams

    clip = _clip_inputs(5)["jpeg"]
    outs = {}
    for pixels in ("host", "device"):
        engine = Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(device="cpu", pixels=pixels, adapter_slots=0))
        params = SamplingParams(max_tokens=4, keep_logits=True)
        engine.add_request(Request(prompt="Which way?", video=clip, images=[_noise(4, 100, 150)], sampling=params,
                                   request_id="a"))
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        outs[pixels] = done["a"]
    assert outs["device"].token_ids == outs["host"].token_ids
    torch.testing.assert_close(torch.stack(outs["device"].logits), torch.stack(outs["host"].logits), atol=1e-4, rtol=0)


def test_a_static_cameras_repeated_jpeg_groups_skip_the_tower(tiny_zoo):
    """Two chunks whose JPEG frames differ only in the first group: the second encodes one group."""
    from serve import Engine, EngineConfig, Request, SamplingParams

    engine = Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(device="cpu", pixels="device", adapter_slots=0,
                                                            enable_prefix_cache=False))
    still = _jpeg(_noise(11, 56, 56))
    chunks = [[_jpeg(f) for f in _noise(seed, 2, 56, 56)] + [still] * 4 for seed in (12, 13)]
    encoded = []
    for chunk in chunks:
        engine.generate(Request(prompt="Any cars?", video=chunk, sampling=SamplingParams(max_tokens=1)))
        encoded.append(engine.stats().items_encoded)
    # the first chunk's two still groups share one key (one encode); the second chunk adds only its
    # new first group
    assert encoded == [2, 3]
