"""Host-side layout of a Qwen vision step: positions, attention segments, window order.

Everything the Qwen towers derive from the items' patch grids (t, h, w) is computed here in
numpy from metadata known when the step is prepared, cached per grid, and moved to the device in
one copy, so the tower's forward never reads a device tensor back.

Row order: the processor emits a frame's patches block-major over the merge x merge blocks (the
merger then takes 4 consecutive rows). Qwen2.5-VL's window layers attend within windows of
`window_size` pixels; its tower runs in window order (merge units regrouped window by window,
within each frame) and restores the input order after the merger.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..forward.segments import Segments, build_segments, plan_arrays, to_device


@lru_cache(maxsize=256)
def _frame_positions(h: int, w: int, merge: int) -> np.ndarray:
    """[h * w, 2] (row, col) of each patch of one frame, block-major over merge x merge blocks."""
    hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return np.stack([a.reshape(shape).transpose(0, 2, 1, 3).ravel() for a in (hh, ww)], axis=1)


@lru_cache(maxsize=256)
def _frame_windows(h: int, w: int, merge: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """One frame's merge units in window order, and the windows' sizes in units (empty ones
    dropped); windows of `window` x `window` units tile the frame from the top left corner."""
    lh, lw = h // merge, w // merge
    units = np.arange(lh * lw).reshape(lh, lw)
    order, sizes = [], []
    for r in range(0, lh, window):
        for c in range(0, lw, window):
            block = units[r:r + window, c:c + window].ravel()
            order.append(block)
            sizes.append(block.size)
    return np.concatenate(order), np.asarray(sizes)


@dataclass
class QwenLayout:
    positions: torch.Tensor  # [rows, 2] (row, col) of each row, in the tower's row order
    frames: Segments  # full attention: one segment per frame group
    windows: Segments | None  # Qwen2.5-VL window layers
    order: torch.Tensor | None  # pixel rows in window order (None: input order)
    restore: torch.Tensor | None  # merged rows back to the input order


def qwen_layout(grids: list[tuple[int, int, int]], merge: int, device, window: int | None = None) -> QwenLayout:
    """grids: (t, h, w) patch grids of the step's items in order; window: Qwen2.5-VL's window in
    merge units (window_size // merge // patch_size), None for Qwen2-VL."""
    for t, h, w in grids:
        if t < 1 or h % merge or w % merge or h < merge or w < merge:
            raise ValueError(f"a patch grid {(t, h, w)} does not tile into {merge} x {merge} merge blocks")
    unit = merge * merge
    positions = np.concatenate([np.tile(_frame_positions(h, w, merge), (t, 1)) for t, h, w in grids])
    frame_lengths = [h * w for t, h, w in grids for _ in range(t)]
    arrays, frame_groups = plan_arrays(frame_lengths, "f")
    window_groups = None
    if window is not None:
        unit_order, window_sizes, base = [], [], 0
        for t, h, w in grids:
            order, sizes = _frame_windows(h, w, merge, window)
            for _ in range(t):
                unit_order.append(order + base)
                window_sizes.append(sizes)
                base += h * w // unit
        unit_order = np.concatenate(unit_order)
        rows = (unit_order[:, None] * unit + np.arange(unit)[None, :]).ravel()
        positions = positions[rows]
        wins, window_groups = plan_arrays(np.concatenate(window_sizes) * unit, "w")
        arrays.update(wins)
        arrays["order"], arrays["restore"] = rows, np.argsort(unit_order)
    arrays["positions"] = positions
    moved = to_device(arrays, device)
    return QwenLayout(
        moved["positions"], build_segments(arrays, frame_groups, moved, "f"),
        None if window is None else build_segments(arrays, window_groups, moved, "w"),
        moved.get("order"), moved.get("restore"))
