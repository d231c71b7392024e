"""Qwen pixel preprocessing in torch, on whatever device the frames are: resize, normalise, patchify.

The same arithmetic as the transformers Qwen2-VL image/video processors (smart resize to a
multiple of patch x merge, bicubic with antialiasing, rescale and normalise fused, temporal
padding by repeating the last frame, the merge-block-major patch order), written for a batch:
frames stay uint8 until they are on the engine's device and every clip of one size is one call.
Parity with the processor is tested (`tests/serve/models/test_pixels.py`): exact on the CPU; on a
GPU exact where no resize is needed (the GPU test measures the resize's difference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen processors' target size: both sides multiples of `factor`, pixels within bounds,
    the aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {height} x {width} has an aspect ratio over 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class QwenPixelSpec:
    """What the checkpoint's processor does to pixels (read from it by `from_processor`)."""

    patch: int
    temporal: int
    merge: int
    image_pixels: tuple[int, int]  # (min, max) pixels of an image
    video_pixels: tuple[int, int]  # (min, max) pixels of a video frame (before any per-clip cap)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    video_cap: tuple[int, float] | None = None  # (max_video_tokens, 0.9): the per-frame cap of newer processors

    @classmethod
    def from_processor(cls, processor) -> "QwenPixelSpec":
        ip, vp = processor.image_processor, processor.video_processor

        def bounds(p):
            size = p.size if isinstance(p.size, dict) else vars(p.size)
            lo = size.get("shortest_edge") or getattr(p, "min_pixels", None)
            hi = size.get("longest_edge") or getattr(p, "max_pixels", None)
            if lo is None or hi is None:
                raise ValueError(f"the processor's size {size} has no shortest_edge / longest_edge pixel bounds")
            return int(lo), int(hi)

        for name in ("do_resize", "do_rescale", "do_normalize"):
            for p in (ip, vp):
                if getattr(p, name, True) is False:
                    raise ValueError(f"the processor has {name}=False; pixels are prepared on the host")
        cap = getattr(vp, "cap_pixels_per_frame", None)
        return cls(int(vp.patch_size), int(vp.temporal_patch_size), int(vp.merge_size), bounds(ip), bounds(vp),
                   tuple(float(x) for x in vp.image_mean), tuple(float(x) for x in vp.image_std),
                   (int(vp.max_video_tokens), 0.9) if cap else None)

    def image_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.patch * self.merge, *self.image_pixels)

    def video_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        lo, hi = self.video_pixels
        factor = self.patch * self.merge
        if self.video_cap is not None:
            tokens, share = self.video_cap
            hi = max(min(hi, int(tokens * factor * factor * share) * self.temporal // frames), int(lo * 1.05))
        return smart_resize(height, width, factor, lo, hi)

    def grid(self, frames: int, size: tuple[int, int]) -> tuple[int, int, int]:
        return -(-frames // self.temporal), size[0] // self.patch, size[1] // self.patch


def resize_frames(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float [N, 3, h, w] holding uint8 levels: bicubic with antialiasing on
    the uint8 frames, as the processor's resize is (its fixed-point uint8 kernel and a float resize
    differ by up to ~20 levels on noise-like edges); where the device has no uint8 kernel, a float
    resize rounded and clamped to uint8 levels."""
    x = frames.permute(0, 3, 1, 2)
    if tuple(x.shape[-2:]) != tuple(size):
        try:
            x = F.interpolate(x.contiguous(), size=size, mode="bicubic", antialias=True, align_corners=False)
        except (RuntimeError, NotImplementedError):  # no uint8 bicubic on this device
            x = F.interpolate(x.float(), size=size, mode="bicubic", antialias=True,
                              align_corners=False).round_().clamp_(0, 255)
    return x.float()


def patchify(videos: torch.Tensor, spec: QwenPixelSpec) -> torch.Tensor:
    """Normalised [B, T, C, H, W] -> [B, grid_t * grid_h * grid_w, C * temporal * patch * patch], the
    processor's row order (merge blocks major, then the patches inside a block)."""
    b, t, c, h, w = videos.shape
    if pad := -t % spec.temporal:
        videos = torch.cat((videos, videos[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
        t += pad
    p, m = spec.patch, spec.merge
    gt, gh, gw = t // spec.temporal, h // p, w // p
    x = videos.reshape(b, gt, spec.temporal, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return x.reshape(b, gt * gh * gw, c * spec.temporal * p * p)


@lru_cache(maxsize=32)
def _mean_std(mean, std, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std in uint8 units, made once per device (a fresh tensor from Python
    values would be a blocking copy every call)."""
    return (torch.tensor(mean, device=device).view(1, 3, 1, 1) * 255.0,
            torch.tensor(std, device=device).view(1, 3, 1, 1) * 255.0)


def qwen_pixels(frames: torch.Tensor, size: tuple[int, int], spec: QwenPixelSpec,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [B, T, H, W, 3] (clips of one shape; an image is T = 1) -> pixel rows [B, rows, width]
    in `dtype`. An image (T = 1) is padded to one temporal patch by repetition, as the processor does."""
    if frames.dtype != torch.uint8 or frames.ndim != 5 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [B, T, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
    b, t = frames.shape[:2]
    x = resize_frames(frames.flatten(0, 1), size)  # [B * T, 3, h, w]
    mean, std = _mean_std(spec.mean, spec.std, str(x.device))
    return patchify(((x - mean) / std).view(b, t, 3, *size), spec).to(dtype)
