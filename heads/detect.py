"""Detection / grounding head: a fixed set of box slots, matched to the targets as a set.

Each of `max_boxes` slots predicts an objectness logit and a box (cx, cy, w, h) through a
sigmoid, so boxes are always inside the normalised image. Training follows DETR's set loss:
slots are matched one-to-one to an image's target boxes by an exact minimum-cost assignment,
matched slots learn their box (L1 + GIoU) and objectness 1, every other slot objectness 0.
Because duplicates are penalised during training, decoding needs no NMS: it keeps the slots
whose score exceeds the threshold.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .assignment import linear_sum_assignment
from .base import TaskHead
from .boxes import cxcywh_to_xyxy, generalized_iou, xyxy_to_cxcywh
from .config import HeadConfig, HeadResult

# Loss and matching-cost weights (DETR's: objectness 1, L1 5, GIoU 2). L1 alone under-weights
# small boxes; GIoU is scale-free and gives non-overlapping boxes a gradient.
OBJECTNESS_WEIGHT = 1.0
L1_WEIGHT = 5.0
GIOU_WEIGHT = 2.0
# Tolerance for coordinates a hair outside [0, 1] after normalising pixel boxes in float.
_COORD_TOL = 1e-4


class DetectHead(TaskHead):
    """outputs: {"logits": [B, S] objectness, "boxes": [B, S, 4] (cx, cy, w, h) in (0, 1)};
    targets: {"boxes": [B, M, 4] (x1, y1, x2, y2), "box_mask": [B, M] bool} (M = most boxes
    of any input in the batch; rows padded at the end)."""

    bounded = True  # a picture cannot hold more target boxes than the head has slots

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        with torch.no_grad():
            # Start every slot at objectness ~0.1: most slots are empty in most images, so a
            # low prior keeps the first steps from being spent unlearning false positives.
            self.proj.bias.view(config.max_boxes, 5)[:, 0] = -math.log(9.0)

    def outputs_from(self, logits: Tensor) -> dict[str, Tensor]:
        slots = logits.view(logits.shape[0], self.config.max_boxes, 5)  # [B, S, 5]
        return {"logits": slots[..., 0], "boxes": slots[..., 1:].sigmoid()}

    @torch.no_grad()
    def match(self, outputs: dict[str, Tensor], targets: dict[str, Tensor]) -> list[list[tuple[int, int]]]:
        """Per input, the (slot, target) pairs of the minimum-cost one-to-one matching."""
        pred = outputs["boxes"].float()  # [B, S, 4] cxcywh
        prob = outputs["logits"].float().sigmoid()  # [B, S]
        tgt = targets["boxes"].to(pred.device, torch.float32)  # [B, M, 4] xyxy
        # cost: [B, M, S], rows = targets so the solver sees rows <= columns
        cost = (-OBJECTNESS_WEIGHT * prob[:, None, :]
                + L1_WEIGHT * (xyxy_to_cxcywh(tgt)[:, :, None] - pred[:, None]).abs().sum(-1)
                - GIOU_WEIGHT * generalized_iou(tgt[:, :, None], cxcywh_to_xyxy(pred)[:, None]))
        cost, valid = cost.cpu().tolist(), targets["box_mask"].cpu().tolist()  # one host copy per batch
        matches = []
        for rows, keep in zip(cost, valid):
            kept = [k for k, ok in enumerate(keep) if ok]
            pairs = linear_sum_assignment([rows[k] for k in kept])
            matches.append(sorted((slot, kept[r]) for r, slot in pairs))
        return matches

    def loss(self, outputs: dict[str, Tensor], targets: dict[str, Tensor]) -> Tensor:
        logits, pred = outputs["logits"], outputs["boxes"]  # [B, S], [B, S, 4]
        tgt = targets["boxes"].to(pred.device, torch.float32)  # [B, M, 4]
        matches = self.match(outputs, targets)
        b_idx = [b for b, pairs in enumerate(matches) for _ in pairs]
        s_idx = [s for pairs in matches for s, _ in pairs]
        t_idx = [t for pairs in matches for _, t in pairs]
        objectness = torch.zeros_like(logits)
        objectness[b_idx, s_idx] = 1.0
        loss = OBJECTNESS_WEIGHT * F.binary_cross_entropy_with_logits(logits, objectness)
        if b_idx:
            matched = pred[b_idx, s_idx]  # [N, 4] cxcywh
            wanted = tgt[b_idx, t_idx]  # [N, 4] xyxy
            # Box terms are averaged per target box so images with many boxes weigh more.
            n = len(b_idx)
            l1 = (matched - xyxy_to_cxcywh(wanted)).abs().sum() / n
            giou = (1.0 - generalized_iou(cxcywh_to_xyxy(matched), wanted)).sum() / n
            loss = loss + L1_WEIGHT * l1 + GIOU_WEIGHT * giou
        return loss

    def decode(self, outputs: dict[str, Tensor], threshold: float | None = None) -> list[HeadResult]:
        """Boxes (x1, y1, x2, y2) clipped to [0, 1] that `kept` picks (score > threshold), best first.

        confidence: the best kept score; when nothing is kept, 1 - the best slot's score (how
        sure the head is that the image holds nothing of the class).
        """
        threshold = self.config.score_threshold if threshold is None else threshold
        scores = outputs["logits"].detach().float().sigmoid().cpu()  # [B, S]: one host copy per batch
        boxes = cxcywh_to_xyxy(outputs["boxes"].detach().float()).clamp(0.0, 1.0).cpu()  # [B, S, 4]
        labels = self.config.labels
        # With several class names the prompt picks the class, which the head cannot see.
        label = labels[0] if labels and len(labels) == 1 else None
        results = []
        for row_scores, row_boxes in zip(scores, boxes):
            kept = self.kept(row_scores, row_boxes, threshold)
            confidence = float(row_scores[kept[0]]) if kept else 1.0 - float(row_scores.max())
            results.append(HeadResult(type="detect", label=label, boxes=[tuple(row_boxes[s].tolist()) for s in kept],
                                      scores=[float(row_scores[s]) for s in kept], confidence=confidence))
        return results

    def kept(self, scores: Tensor, boxes: Tensor, threshold: float) -> list[int]:
        """The slots decoded as boxes, best first: those scoring above the threshold."""
        order = scores.argsort(descending=True, stable=True).tolist()
        return [s for s in order if scores[s] > threshold]

    def targets_from(self, examples: list[Any], device: torch.device | str | None = None) -> dict[str, Tensor]:
        """Each example: a list (possibly empty) of boxes (x1, y1, x2, y2) normalised to [0, 1]."""
        per_input = [self._check_boxes(n, ex) for n, ex in enumerate(examples)]
        most = max((len(b) for b in per_input), default=0)
        boxes = torch.zeros(len(per_input), most, 4)
        mask = torch.zeros(len(per_input), most, dtype=torch.bool)
        for n, rows in enumerate(per_input):
            if rows:
                boxes[n, : len(rows)] = torch.tensor(rows, dtype=torch.float32)
                mask[n, : len(rows)] = True
        return {"boxes": boxes.to(device), "box_mask": mask.to(device)}

    def _check_boxes(self, n: int, example: Any) -> list[list[float]]:
        if isinstance(example, Tensor):
            example = example.tolist()
        rows = []
        for k, box in enumerate(example):
            box = list(box) if isinstance(box, (list, tuple, Tensor)) else [box]
            if len(box) != 4 or not all(isinstance(c, (int, float)) and math.isfinite(c) for c in box):
                raise ValueError(f"targets[{n}][{k}]={box!r}: a box is four finite numbers (x1, y1, x2, y2)")
            if min(box) < -_COORD_TOL or max(box) > 1 + _COORD_TOL:
                raise ValueError(f"targets[{n}][{k}]={box!r}: coordinates must be normalised to [0, 1]")
            x1, y1, x2, y2 = (min(max(float(c), 0.0), 1.0) for c in box)
            if not (x1 < x2 and y1 < y2):
                raise ValueError(f"targets[{n}][{k}]={box!r}: need x1 < x2 and y1 < y2 (xyxy order, "
                                 "non-empty box)")
            rows.append([x1, y1, x2, y2])
        if self.bounded and len(rows) > self.config.max_boxes:
            raise ValueError(f"targets[{n}]: {len(rows)} boxes but the head has max_boxes="
                             f"{self.config.max_boxes} slots; raise max_boxes in the head config")
        return rows
