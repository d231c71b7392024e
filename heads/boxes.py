"""Box geometry shared by the detection loss and the metrics.

Boxes are normalised to [0, 1]. Every function broadcasts over leading dimensions, so the same
code gives elementwise values for matched pairs (`a: [N, 4]`, `b: [N, 4]`) and pairwise
matrices (`a[:, None]`, `b[None, :]`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

# Keeps IoU finite (and its gradient defined) for zero-area boxes; far below any real area.
_EPS = 1e-9


def cxcywh_to_xyxy(boxes: Tensor) -> Tensor:
    """[..., 4] (cx, cy, w, h) -> [..., 4] (x1, y1, x2, y2)."""
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2), dim=-1)


def xyxy_to_cxcywh(boxes: Tensor) -> Tensor:
    """[..., 4] (x1, y1, x2, y2) -> [..., 4] (cx, cy, w, h)."""
    x1, y1, x2, y2 = boxes.unbind(-1)
    return torch.stack(((x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1), dim=-1)


def _area(boxes: Tensor) -> Tensor:
    return (boxes[..., 2] - boxes[..., 0]).clamp_min(0) * (boxes[..., 3] - boxes[..., 1]).clamp_min(0)


def _inter_union(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    lt = torch.maximum(a[..., :2], b[..., :2])
    rb = torch.minimum(a[..., 2:], b[..., 2:])
    inter = (rb - lt).clamp_min(0).prod(dim=-1)
    return inter, _area(a) + _area(b) - inter


def iou(a: Tensor, b: Tensor) -> Tensor:
    """IoU of xyxy boxes, broadcasting: a [..., 4], b [..., 4] -> [...]."""
    inter, union = _inter_union(a, b)
    return inter / union.clamp_min(_EPS)


def generalized_iou(a: Tensor, b: Tensor) -> Tensor:
    """GIoU of xyxy boxes, broadcasting; in [-1, 1].

    Unlike IoU it still has a gradient when the boxes do not overlap (the enclosing-box term),
    which is what lets a far-off predicted box move toward its target.
    """
    inter, union = _inter_union(a, b)
    enclose = _area(torch.cat((torch.minimum(a[..., :2], b[..., :2]), torch.maximum(a[..., 2:], b[..., 2:])), -1))
    return inter / union.clamp_min(_EPS) - (enclose - union) / enclose.clamp_min(_EPS)


def as_boxes(boxes: Tensor | Sequence[Sequence[float]] | Sequence[float]) -> Tensor:
    """A box, a list of boxes or a tensor -> float tensor [N, 4] (N may be 0)."""
    t = torch.as_tensor(boxes, dtype=torch.float64) if not isinstance(boxes, Tensor) else boxes.double()
    if t.numel() == 0:
        return t.reshape(0, 4)
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[-1] != 4:
        raise ValueError(f"boxes: expected [N, 4] (x1, y1, x2, y2), got shape {tuple(t.shape)}")
    return t


def box_iou(a: Tensor | Sequence, b: Tensor | Sequence) -> Tensor:
    """Pairwise IoU of xyxy boxes: a [N, 4] (or one box), b [M, 4] -> [N, M], float64."""
    a, b = as_boxes(a), as_boxes(b)
    return iou(a[:, None], b[None, :])
