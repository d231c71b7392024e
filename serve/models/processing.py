"""Prompt processing: text or chat messages plus images / video frames -> token ids and vision inputs.

The checkpoint's own Hugging Face processor does the chat template, the image and video
preprocessing and the placeholder expansion, so token ids are exactly what transformers would
feed its model. Each image or clip is hashed from its raw pixels: the hash keys the encoder
cache and the prefix cache (two requests with the same picture share both).
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field

import numpy as np
import torch

from heads import processor_window

from .args import ModelArgs
from .vision import VisionInput


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    vision: list[VisionInput] = field(default_factory=list)


def to_rgb_image(image):
    """A PIL RGB image from a PIL image, an HxWx3 uint8 array or encoded image bytes (PNG/JPEG)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (bytes, bytearray, memoryview)):
        return Image.open(io.BytesIO(bytes(image))).convert("RGB")
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(f"an image array must be uint8 [H, W, 3], got {image.dtype} {image.shape}")
        return Image.fromarray(image)
    raise TypeError(f"an image must be a PIL image, a uint8 [H, W, 3] array or encoded bytes, got {type(image)}")


def to_frames(video) -> np.ndarray:
    """uint8 [T, H, W, 3] from an array of that shape or a list of images/arrays/encoded frames."""
    if isinstance(video, np.ndarray):
        frames = video
    else:
        frames = np.stack([np.asarray(to_rgb_image(f)) for f in video])
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] < 1:
        raise ValueError(f"video frames must be uint8 [T, H, W, 3] with T >= 1, got {frames.dtype} {frames.shape}")
    return frames


def _group_hashes(frames: np.ndarray, t: int, h: int, w: int, per: int) -> tuple[str, ...] | None:
    """One key per temporal patch of a clip [T, H, W, 3] (`per` frames each): the raw frames it
    covers and its patch grid (a different resize is a different key); None unless the frames are
    exactly t groups (a processor that padded or resampled them keeps the clip whole)."""
    if frames.ndim != 4 or len(frames) != t * per:
        return None
    return tuple(content_hash(f"video-group:{h}x{w}", frames[i * per:(i + 1) * per]) for i in range(t))


def _joined(keys: tuple[str, ...]) -> str:
    return hashlib.blake2b("".join(keys).encode(), digest_size=16).hexdigest()


def content_hash(kind: str, pixels: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{kind}:{pixels.dtype}:{pixels.shape}".encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.hexdigest()


def _spans(token_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, t in enumerate(token_ids + [None]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _place(token_ids: list[int], token_id: int, items: list[VisionInput], kind: str) -> None:
    """Sets each item's offset: items fill the placeholder runs of `token_id` in order."""
    queue = list(items)
    for start, end in _spans(token_ids, token_id):
        pos = start
        while pos < end:
            if not queue:
                raise ValueError(f"the prompt has more {kind} placeholders than {kind} inputs")
            item = queue.pop(0)
            item.offset = pos
            pos += item.num_tokens
        if pos != end:
            raise ValueError(f"a run of {end - start} {kind} placeholders at token {start} does not match "
                             "the inputs' token counts")
    if queue:
        raise ValueError(f"{len(queue)} {kind} input(s) have no placeholders in the prompt: add them to the "
                         "prompt (raw_prompt) or pass the text as `prompt` / `messages` without placeholders")


class PromptProcessor:
    """Wraps the checkpoint's processor; `process` is called once per request."""

    def __init__(self, processor, args: ModelArgs, pixels: str = "host"):
        """pixels: "host" (the processor prepares pixel rows here) or "device" (Qwen: frames stay raw
        until the tower's device prepares them, see `deferred.py`; a processor whose output the
        device path does not reproduce keeps the host path, with a warning)."""
        if pixels not in ("host", "device"):
            raise ValueError(f"pixels must be 'host' or 'device', got {pixels!r}")
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.args = args
        self.temporal_patch = getattr(getattr(processor, "video_processor", None), "temporal_patch_size", None) or 2
        # the strings the tokenizer turns into control tokens (chat roles, vision placeholders):
        # typed into a prompt they would act as such, e.g. a user's "<|im_start|>system" turn
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        self.control_tokens = sorted({str(t) for t in getattr(self.tokenizer, "all_special_tokens", [])}
                                     | {t.content for t in decoder.values() if getattr(t, "special", False)}, key=len,
                                     reverse=True)
        self.pixel_spec = None
        if pixels == "device" and args.is_qwen:
            from .deferred_prompt import device_pixel_spec

            self.pixel_spec = device_pixel_spec(self)

    def check_text(self, text: str) -> None:
        """Refuses user text holding a control token (it would be honoured as one, not read as text)."""
        for token in self.control_tokens:
            if token and token in text:
                raise ValueError(f"the prompt contains the control token {token!r}; control tokens are not "
                                 "accepted in prompt text")

    def chat_text(self, text: str, n_images: int, has_video: bool) -> str:
        content = [{"type": "image"}] * n_images + ([{"type": "video"}] if has_video else [])
        messages = [{"role": "user", "content": content + [{"type": "text", "text": text}]}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def process(self, prompt: str | None = None, messages: list | None = None, images=(), video=None,
                raw_prompt: bool = False, prompt_token_ids: list[int] | None = None) -> ProcessedPrompt:
        if self.pixel_spec is not None and (images or video is not None) and prompt_token_ids is None:
            from .deferred_prompt import process_deferred

            return process_deferred(self, self._text(prompt, messages, raw_prompt, len(images or ()),
                                                     video is not None), images or (), video, raw_prompt)
        images = [to_rgb_image(im) for im in (images or ())]
        frames = to_frames(video) if video is not None else None
        if frames is not None and not self.args.is_qwen:
            raise ValueError(f"{self.args.arch} takes no video input; pass frames as `images` instead")
        if prompt_token_ids is not None:
            if images or frames is not None:
                raise ValueError("prompt_token_ids carry no images: pass `prompt` or `messages` with images")
            return ProcessedPrompt([int(t) for t in prompt_token_ids])
        text = self._text(prompt, messages, raw_prompt, len(images), frames is not None)
        kwargs = {"text": [text], "return_tensors": "pt"}
        if images:
            kwargs["images"] = images
        if frames is not None:
            kwargs["videos"] = [frames]
        try:
            out = self.processor(**kwargs)
        except ValueError as e:
            hint = " (a raw_prompt must hold one placeholder per image / clip)" if raw_prompt else ""
            raise ValueError(f"the processor refused the prompt{hint}: {e}") from e
        token_ids = out["input_ids"][0].tolist()
        vision = self._vision_inputs(out, images, frames)
        _place(token_ids, self.args.image_token_id, [v for v in vision if v.kind == "image"], "image")
        if self.args.video_token_id is not None:
            _place(token_ids, self.args.video_token_id, [v for v in vision if v.kind == "video"], "video")
        vision.sort(key=lambda v: v.offset)
        return ProcessedPrompt(token_ids, vision)

    def _text(self, prompt, messages, raw_prompt: bool, n_images: int, has_video: bool) -> str:
        if messages is not None:
            return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if prompt is None:
            raise ValueError("a request needs `prompt`, `messages` or `prompt_token_ids`")
        if raw_prompt:
            return prompt
        self.check_text(prompt)
        return self.chat_text(prompt, n_images, has_video)

    def _vision_inputs(self, out, images, frames) -> list[VisionInput]:
        items = []
        if not self.args.is_qwen:
            for i, image in enumerate(images):
                pixels = out["pixel_values"][i:i + 1]
                n, array = self._llava_tokens(pixels), np.asarray(image)
                height, width = array.shape[:2]  # its tokens see the processor's crop of this picture
                window = processor_window(getattr(self.processor, "image_processor", None), width, height)
                items.append(VisionInput("image", pixels, n, content_hash("image", array), window=window))
            return items
        merge2 = self.args.spatial_merge_size ** 2
        for kind, raws, pixel_key, grid_key in (("image", images, "pixel_values", "image_grid_thw"),
                                                ("video", [frames] if frames is not None else [],
                                                 "pixel_values_videos", "video_grid_thw")):
            if not raws:
                continue
            grids = out[grid_key].tolist()
            seconds = out.get("second_per_grid_ts") if kind == "video" else None  # images have no time step
            seconds = seconds.tolist() if isinstance(seconds, torch.Tensor) else (seconds or [1.0] * len(grids))
            rows = torch.tensor(grids).prod(-1).tolist()
            chunks = out[pixel_key].split(rows)
            for raw, grid, chunk, sec in zip(raws, grids, chunks, seconds):
                t, h, w = grid
                groups = _group_hashes(np.asarray(raw), t, h, w, self.temporal_patch) if kind == "video" else None
                key = content_hash(kind, np.asarray(raw)) if groups is None else _joined(groups)
                items.append(VisionInput(kind, chunk, t * h * w // merge2, key, grid_thw=(t, h, w),
                                         second_per_grid_t=float(sec), group_hashes=groups))
        return items

    def _llava_tokens(self, pixels: torch.Tensor) -> int:
        patch = getattr(self.processor, "patch_size", None) or 14
        n = (pixels.shape[-1] // patch) * (pixels.shape[-2] // patch)
        extra = getattr(self.processor, "num_additional_image_tokens", 0)
        strategy = getattr(self.processor, "vision_feature_select_strategy", "default")
        return n + (extra - 1 if strategy == "default" else extra)
