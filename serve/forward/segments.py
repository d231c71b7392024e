"""Attention within segments of packed rows: the vision towers' frames, windows and images.

A step's vision rows are packed [rows, heads, dim]; every segment (one frame group of a clip, one
attention window, one image) attends only to itself, bidirectionally. The transformers towers
launch one attention per segment per layer (thousands per step for a batch of camera chunks);
here one layer costs one launch:

- "varlen": a variable-length flash kernel over the cumulative lengths (CUDA, fp16/bf16, a torch
  that has `torch.nn.attention.varlen`);
- "batched": the segments of one length as one batched `scaled_dot_product_attention` call; a
  step's frames mostly share a size, so that is one call, and one per distinct length otherwise
  (rows gathered by an index built on the host). It is the CPU path and the fallback.

"auto" on a GPU takes the batched call (cuDNN's attention, the faster) for a step of one length whose
shape this thread has already run, and the varlen kernel for everything else: cuDNN plans each new
shape on the host, mid-step (segment_plans.py says why and how the warm-up builds them).

Everything a layer needs is computed on the host from the segment lengths, once per step
(`plan_segments`), and reaches the device in one copy (`to_device`): no `.item()` / `.tolist()`
in the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import segment_plans
from .segment_plans import equal_segments

MODES = ("auto", "varlen", "batched")


def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None
    return varlen_attn


def to_device(arrays: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    """Integer host arrays as device tensors (int64) through one pinned copy: a step's layout costs
    one transfer, queued without waiting for the GPU."""
    keys = list(arrays)
    flat = np.concatenate([np.asarray(arrays[k], dtype=np.int64).ravel() for k in keys]) if keys else np.zeros(0)
    host = torch.from_numpy(flat.astype(np.int64, copy=False))
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
    moved = host.to(device, non_blocking=True)
    out, at = {}, 0
    for k in keys:
        n = int(np.asarray(arrays[k]).size)
        out[k] = moved[at:at + n].view(np.asarray(arrays[k]).shape)
        at += n
    return out


@dataclass
class Segments:
    """One layer kind's segmentation of the packed rows (built by `plan_segments`)."""

    rows: int
    cu: torch.Tensor  # int32 [n + 1] on the device: cumulative segment starts
    max_len: int
    # per distinct length: (length, number of segments, row index on the device or None when the
    # segments of that length are all of the rows, in order)
    groups: list[tuple[int, int, torch.Tensor | None]]


def plan_arrays(lengths, prefix: str) -> tuple[dict[str, np.ndarray], list[tuple[int, int, str | None]]]:
    """Host half of `plan_segments`: the arrays to move and, per distinct length, its key."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0 or (lengths <= 0).any():
        raise ValueError(f"segment lengths must be positive, got {lengths.tolist()[:8]}")
    starts = np.concatenate([[0], np.cumsum(lengths)])
    arrays = {f"{prefix}cu": starts}
    groups = []
    distinct = np.unique(lengths)
    for length in distinct.tolist():
        picked = np.flatnonzero(lengths == length)
        if len(distinct) == 1:
            groups.append((length, len(picked), None))
            continue
        key = f"{prefix}rows{length}"
        arrays[key] = (starts[picked][:, None] + np.arange(length)[None, :]).ravel()
        groups.append((length, len(picked), key))
    return arrays, groups


def plan_segments(lengths, device) -> Segments:
    arrays, groups = plan_arrays(lengths, "")
    moved = to_device(arrays, device)
    return build_segments(arrays, groups, moved, "")


def build_segments(arrays, groups, moved: dict[str, torch.Tensor], prefix: str) -> Segments:
    starts = arrays[f"{prefix}cu"]
    lengths = np.diff(starts)
    return Segments(int(starts[-1]), moved[f"{prefix}cu"].to(torch.int32), int(lengths.max()),
                    [(length, count, None if key is None else moved[key]) for length, count, key in groups])


def _batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
    if len(seg.groups) == 1 and seg.groups[0][2] is None:
        length, count, _ = seg.groups[0]
        return equal_segments(q, k, v, length, count)
    out = torch.empty_like(q)
    for length, count, rows in seg.groups:
        out.index_copy_(0, rows, equal_segments(q[rows], k[rows], v[rows], length, count))
    return out


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments,
                      mode: str = "auto") -> torch.Tensor:
    """q, k, v: [rows, heads, dim] -> [rows, heads, dim]; each segment attends within itself
    (scale 1/sqrt(dim))."""
    if mode not in MODES:
        raise ValueError(f"segment attention mode must be one of {MODES}, got {mode!r}")
    if q.shape[0] != seg.rows:
        raise ValueError(f"{q.shape[0]} rows against segments covering {seg.rows}")
    varlen = _varlen()
    if mode == "auto" and not q.is_cuda and segment_plans.is_recording():
        _planned(q, k, v, seg)  # the warm-up's record on any device (its layouts are the same on a GPU)
    use_varlen = (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and varlen is not None
                  and mode in ("auto", "varlen") and not (mode == "auto" and _planned(q, k, v, seg)))
    if mode == "varlen" and not use_varlen:
        raise ValueError("varlen attention needs CUDA, fp16/bf16 and torch >= 2.9")
    if use_varlen:
        return varlen(q, k, v, seg.cu, seg.cu, seg.max_len, seg.max_len)
    return _batched(q, k, v, seg)


def _planned(q, k, v, seg: Segments) -> bool:
    """auto's test for the batched call: one length, at a shape this thread has run."""
    if len(seg.groups) != 1 or seg.groups[0][2] is not None:
        return False
    length, count, _ = seg.groups[0]
    return segment_plans.known(segment_plans.shape_key(q, k, v, length, count))
