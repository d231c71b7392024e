"""The host half of device-side pixels: a Qwen prompt's token ids and vision items, frames left raw.

What the checkpoint's processor would do, minus the pixel work: each image or clip's target size
and patch grid (`QwenPixelSpec`), the placeholder expansion of the chat text, tokenisation, the
content hashes. `device_pixel_spec` checks once, on a small synthetic image and clip, that this
reproduces the processor's token ids, grids and pixel rows; a processor it does not reproduce
keeps the host path.
"""

from __future__ import annotations

import hashlib
import logging
import re

import numpy as np

from .deferred import Deferred, jpeg_size, materialize
from .pixels import QwenPixelSpec
from .processing import (ProcessedPrompt, _group_hashes, _joined, _place, content_hash, to_frames,
                         to_rgb_image)
from .vision import VisionInput

log = logging.getLogger(__name__)


def _jpeg_frames(video) -> tuple[list[bytes], tuple[int, int]] | None:
    """A clip sent as JPEG frames of one size, kept encoded; None for anything else."""
    if isinstance(video, np.ndarray) or not isinstance(video, (list, tuple)) or not video:
        return None
    if not all(isinstance(f, (bytes, bytearray, memoryview)) for f in video):
        return None
    frames = [bytes(f) for f in video]
    sizes = {jpeg_size(f) for f in frames}
    if len(sizes) != 1 or None in sizes:
        return None
    return frames, sizes.pop()


def _jpeg_group_hashes(frames: list[bytes], per: int, size: tuple[int, int]) -> tuple[str, ...] | None:
    if len(frames) % per:
        return None
    keys = []
    for i in range(0, len(frames), per):
        h = hashlib.blake2b(f"jpeg-group:{size[0]}x{size[1]}".encode(), digest_size=16)
        for data in frames[i:i + per]:
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        keys.append(h.hexdigest())
    return tuple(keys)


def _expand(text: str, token: str, counts: list[int]) -> str:
    """Each occurrence of `token` in order becomes `counts[i]` copies of it, as the processor does."""
    parts = text.split(token)
    if len(parts) - 1 != len(counts):
        return text  # the placeholder check (`_place`) names the mismatch
    return parts[0] + "".join(token * n + rest for n, rest in zip(counts, parts[1:]))


def process_deferred(pp, text: str, images, video, raw_prompt: bool) -> ProcessedPrompt:
    spec: QwenPixelSpec = pp.pixel_spec
    merge2 = spec.merge ** 2
    items: list[VisionInput] = []
    for image in images:
        array = np.asarray(to_rgb_image(image))
        h, w = array.shape[:2]
        size = spec.image_size(h, w)
        t, gh, gw = spec.grid(1, size)
        items.append(VisionInput("image", None, t * gh * gw // merge2, content_hash("image", array), (t, gh, gw),
                                 deferred=Deferred(array[None], (h, w), size, spec)))
    seconds = pp.seconds_per_group
    if video is not None:
        encoded = _jpeg_frames(video)
        if encoded is not None:
            frames, (h, w) = encoded
            groups = _jpeg_group_hashes(frames, spec.temporal, (h, w))
            key = _joined(groups) if groups else content_hash("video-jpeg", np.frombuffer(b"".join(frames), np.uint8))
        else:
            frames = to_frames(video)
            h, w = frames.shape[1:3]
        size = spec.video_size(len(frames), h, w)
        grid = spec.grid(len(frames), size)
        if encoded is None:
            groups = _group_hashes(frames, *grid, spec.temporal)
            key = content_hash("video", frames) if groups is None else _joined(groups)
        items.append(VisionInput("video", None, grid[0] * grid[1] * grid[2] // merge2, key, grid, seconds,
                                 group_hashes=groups, deferred=Deferred(frames, (h, w), size, spec)))
    image_token = getattr(pp.processor, "image_token", "<|image_pad|>")
    video_token = getattr(pp.processor, "video_token", "<|video_pad|>")
    expanded = _expand(text, image_token, [v.num_tokens for v in items if v.kind == "image"])
    expanded = _expand(expanded, video_token, [v.num_tokens for v in items if v.kind == "video"])
    token_ids = list(pp.tokenizer([expanded])["input_ids"][0])
    try:
        _place(token_ids, pp.args.image_token_id, [v for v in items if v.kind == "image"], "image")
        _place(token_ids, pp.args.video_token_id, [v for v in items if v.kind == "video"], "video")
    except ValueError as e:
        hint = " (a raw_prompt must hold one placeholder per image / clip)" if raw_prompt else ""
        raise ValueError(f"the processor refused the prompt{hint}: {e}") from e
    items.sort(key=lambda v: v.offset)
    return ProcessedPrompt(token_ids, items)


def device_pixel_spec(pp) -> QwenPixelSpec | None:
    """The processor's pixel spec when the deferred path reproduces it on a synthetic image and
    clip (sizes that need a resize, an odd frame count), else None (with a warning)."""
    try:
        spec = QwenPixelSpec.from_processor(pp.processor)
    except (AttributeError, TypeError, ValueError) as e:
        log.warning("device pixel preprocessing is off: %s", e)
        return None
    rng = np.random.default_rng(0)
    clip = rng.integers(0, 256, (3, 60, 90, 3), dtype=np.uint8)
    image = rng.integers(0, 256, (70, 50, 3), dtype=np.uint8)
    try:
        want = pp.process("check", images=[image], video=clip)  # the processor's own path (pixel_spec is None)
        # the clip's seconds per frame group: the processor's default frame rate, the same for every clip
        pp.seconds_per_group = next(v.second_per_grid_t for v in want.vision if v.kind == "video")
        pp.pixel_spec = spec
        got = pp.process("check", images=[image], video=clip)
        rows = materialize([v.deferred for v in got.vision], "cpu", want.vision[0].pixel_values.dtype)
        same = (got.token_ids == want.token_ids
                and [(v.grid_thw, v.offset) for v in got.vision] == [(v.grid_thw, v.offset) for v in want.vision]
                and all(r.shape == v.pixel_values.shape and float((r - v.pixel_values).abs().max()) < 1e-4
                        for r, v in zip(rows, want.vision)))
    except Exception as e:  # noqa: BLE001 - any failure of the check keeps the host path
        same, reason = False, f"{type(e).__name__}: {e}"
    else:
        reason = "token ids, grids or pixel rows differ from the processor's"
    if not same:
        log.warning("device pixel preprocessing is off for this processor: %s", re.sub(r"\s+", " ", reason)[:300])
        pp.pixel_spec = None
        return None
    return spec
