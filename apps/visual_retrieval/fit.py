"""Photos sized for the server and boxes mapped back: a photo over the pixel limit the client is
configured with (the server's rpc.max_frame_pixels, 3840x2160 by default) is downscaled, keeping
its aspect ratio, before it is sent, and the boxes of its answer, in pixels of the frame sent, are
mapped back to the photo's own pixels for scoring and drawing.

Grounding conventions (`GROUNDINGS`), how a model's native `<|box_start|>(x1,y1),(x2,y2)<|box_end|>`
boxes are read: Qwen2-VL writes them on a 0-1000 grid of the image; Qwen2.5-VL writes absolute
pixels of its resized input, in the native form and in its JSON `"bbox_2d"` answers
(`qwen_resized_size`, the processor's smart_resize with the released checkpoints' min / max pixels:
a server whose processor is configured otherwise resizes differently, and its boxes shift).
"""

from __future__ import annotations

import math

import cv2
import numpy as np

from apps.common.answers import Box

GROUNDINGS = ("qwen2_vl", "qwen2_5_vl")
QWEN_PATCH_FACTOR = 28  # 14-pixel patches merged 2x2
QWEN_MIN_PIXELS = 56 * 56  # preprocessor_config.json of the released Qwen2.5-VL checkpoints
QWEN_MAX_PIXELS = 12845056


def fit_image(image: np.ndarray, max_pixels: int) -> np.ndarray:
    """`image` [H, W, 3] itself when H * W <= max_pixels, else downscaled (area interpolation) to the
    largest size of the same aspect ratio within max_pixels."""
    if max_pixels < 1:
        raise ValueError(f"max_frame_pixels must be >= 1, got {max_pixels}")
    h, w = image.shape[:2]
    if h * w <= max_pixels:
        return image
    s = math.sqrt(max_pixels / (h * w))
    nw, nh = max(1, int(w * s)), max(1, int(h * s))
    while nw * nh > max_pixels:  # float rounding at the edge
        nw, nh = (nw - 1, nh) if nw >= nh else (nw, nh - 1)
    return cv2.resize(image, (nw, nh), interpolation=cv2.INTER_AREA)


def map_boxes(boxes: list[Box], sent: tuple[int, int], original: tuple[int, int]) -> list[Box]:
    """Boxes in pixels of the frame sent (width, height) as pixels of the original photo."""
    sx, sy = original[0] / sent[0], original[1] / sent[1]
    return [(x1 * sx, y1 * sy, x2 * sx, y2 * sy) for x1, y1, x2, y2 in boxes]


def qwen_resized_size(width: int, height: int, factor: int = QWEN_PATCH_FACTOR, min_pixels: int = QWEN_MIN_PIXELS,
                      max_pixels: int = QWEN_MAX_PIXELS) -> tuple[int, int]:
    """(width, height) of the input Qwen2-VL / Qwen2.5-VL processors resize an image to
    (transformers' smart_resize): multiples of `factor`, within [min_pixels, max_pixels]."""
    h_bar, w_bar = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return w_bar, h_bar


def native_box_size(grounding: str, width: int, height: int) -> tuple[int, int] | None:
    """The size native boxes' absolute pixels refer to: None for Qwen2-VL's 0-1000 grid."""
    if grounding not in GROUNDINGS:
        raise ValueError(f"grounding must be one of {GROUNDINGS}, got {grounding!r}")
    return qwen_resized_size(width, height) if grounding == "qwen2_5_vl" else None
