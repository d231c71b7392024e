"""Where each visual token of a prompt looks in its picture: the centre of its cell, normalised to
the original picture, for heads that read boxes off the image's own tokens (`DenseDetectHead`).

A prompt's `token_xy` is [T, 2] (x, y) with `NOT_VISUAL` (-1) on every text token. The tower's
token grid covers a window of the picture: all of it when the processor resizes (Qwen), the centre
square when it resizes the shortest side and crops (CLIP / LLaVA-1.5); `center_crop_window` gives
that window, so a cell maps back to the picture the boxes are labelled in.
"""

from __future__ import annotations

from collections.abc import Iterable

import math
from typing import Any

import torch
from torch import Tensor

NOT_VISUAL = -1.0
FULL = (0.0, 0.0, 1.0, 1.0)  # (x1, y1, x2, y2) of the picture a grid covers, normalised


def grid_xy(rows: int, cols: int, frames: int = 1, window: tuple[float, float, float, float] = FULL) -> Tensor:
    """Cell centres [frames * rows * cols, 2] in the towers' token order (frame, row, column)."""
    if min(rows, cols, frames) < 1:
        raise ValueError(f"grid_xy: rows={rows}, cols={cols}, frames={frames} must all be >= 1")
    x1, y1, x2, y2 = window
    xs = x1 + (torch.arange(cols, dtype=torch.float32) + 0.5) / cols * (x2 - x1)
    ys = y1 + (torch.arange(rows, dtype=torch.float32) + 0.5) / rows * (y2 - y1)
    cells = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), dim=-1).reshape(-1, 2)  # row-major
    return cells.repeat(frames, 1)


def center_crop_window(width: int, height: int, shortest_edge: int, crop_width: int,
                       crop_height: int) -> tuple[float, float, float, float]:
    """The part of a width x height picture left after resizing its shortest side to `shortest_edge`
    and cropping crop_width x crop_height from the centre, normalised to the picture."""
    scale = shortest_edge / min(width, height)
    w, h = width * scale, height * scale
    cw, ch = min(crop_width, w), min(crop_height, h)
    return ((w - cw) / 2 / w, (h - ch) / 2 / h, (w + cw) / 2 / w, (h + ch) / 2 / h)


def processor_window(image_processor: Any, width: int, height: int) -> tuple[float, float, float, float]:
    """The window of a width x height picture that a CLIP-style image processor keeps: its centre crop
    when it resizes the shortest side and crops, else the whole picture."""
    if getattr(image_processor, "do_center_crop", False) and getattr(image_processor, "do_resize", True):
        size, crop = dict(image_processor.size), dict(image_processor.crop_size)
        return center_crop_window(width, height, size["shortest_edge"], crop["width"], crop["height"])
    return FULL


def square_cells(n: int, window: tuple[float, float, float, float] = FULL) -> Tensor:
    """[n, 2] for one picture of a square patch grid (CLIP): the tokens past the largest square are
    leading class tokens, which see the whole picture and get no cell."""
    side = math.isqrt(n)
    return torch.cat([torch.full((n - side * side, 2), NOT_VISUAL), grid_xy(side, side, window=window)])


def prompt_token_xy(length: int, spans: Iterable[tuple[int, Tensor]]) -> Tensor:
    """[length, 2] token_xy of a prompt: each (start, cell centres [n, 2]) span placed at its
    tokens, `NOT_VISUAL` elsewhere."""
    out = torch.full((length, 2), NOT_VISUAL)
    for start, cells in spans:
        if start < 0 or start + cells.shape[0] > length:
            raise ValueError(f"prompt_token_xy: a span of {cells.shape[0]} tokens at {start} does not fit "
                             f"a prompt of {length}")
        out[start:start + cells.shape[0]] = cells
    return out
