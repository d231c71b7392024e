"""Dataset-level scores for head outputs: accuracy, exact match and detection F1 at an IoU.

These are the numbers the fusion step compares against each application's accuracy target,
so they take plain python values (labels, counts, answers, box lists) as well as tensors.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from .boxes import as_boxes, box_iou

__all__ = ["accuracy", "exact_match", "box_iou", "detection_counts", "f1_at_iou"]


def _as_list(values: Any, name: str) -> list:
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name}: expected a sequence of values, got {type(values).__name__}")
    return list(values)


def _paired(pred: Any, target: Any) -> tuple[list, list]:
    pred, target = _as_list(pred, "pred"), _as_list(target, "target")
    if len(pred) != len(target):
        raise ValueError(f"pred has {len(pred)} items but target has {len(target)}; they must pair up")
    if not pred:
        raise ValueError("pred and target are empty; a score over no examples is undefined")
    return pred, target


def accuracy(pred: Any, target: Any) -> float:
    """Fraction of positions where pred == target (labels, counts, answers, or tensors of them)."""
    pred, target = _paired(pred, target)
    return sum(p == t for p, t in zip(pred, target)) / len(pred)


def _normalise(text: str) -> str:
    # Generated answers differ from references in case, spacing and a final full stop
    # ("Yes." vs "yes"); those differences are not errors.
    return re.sub(r"\s+", " ", str(text).strip().lower()).rstrip(".!?").strip()


def exact_match(pred: str | Sequence[str], target: str | Sequence[str]) -> float:
    """Fraction of answers equal to their reference after normalising case, whitespace and
    final punctuation. Two strings score 1.0 or 0.0; two sequences score the mean."""
    if isinstance(pred, str) and isinstance(target, str):
        return float(_normalise(pred) == _normalise(target))
    pred, target = _paired(pred, target)
    return sum(_normalise(p) == _normalise(t) for p, t in zip(pred, target)) / len(pred)


def detection_counts(pred_boxes_per_image: Sequence, target_boxes_per_image: Sequence,
                     iou: float = 0.5) -> dict[str, float]:
    """True/false positives and negatives over a dataset, with precision, recall and F1.

    Per image, predicted and target boxes (x1, y1, x2, y2) are matched greedily: pairs are
    taken in descending IoU, each box used at most once, and a pair counts only at IoU >= iou.
    Taking pairs by IoU (not by prediction order) makes the score independent of the order in
    which boxes are listed. F1 = 2TP / (2TP + FP + FN); it, precision and recall are 1.0 when
    their denominator is 0 (nothing to find and nothing found).
    """
    if not 0.0 < iou <= 1.0:
        raise ValueError(f"iou={iou!r}: must be in (0, 1]")
    preds, targets = _as_list(pred_boxes_per_image, "pred_boxes_per_image"), \
        _as_list(target_boxes_per_image, "target_boxes_per_image")
    if len(preds) != len(targets):
        raise ValueError(f"pred_boxes_per_image has {len(preds)} images but target_boxes_per_image "
                         f"has {len(targets)}; they must pair up")
    tp = fp = fn = 0
    for pred, target in zip(preds, targets):
        pred, target = as_boxes(pred), as_boxes(target)
        ious = box_iou(pred, target).tolist()  # [P][G]
        pairs = sorted(((v, p, g) for p, row in enumerate(ious) for g, v in enumerate(row) if v >= iou),
                       key=lambda x: -x[0])
        used_p, used_g = set(), set()
        for _, p, g in pairs:
            if p not in used_p and g not in used_g:
                used_p.add(p)
                used_g.add(g)
        tp += len(used_p)
        fp += len(pred) - len(used_p)
        fn += len(target) - len(used_g)
    precision = tp / (tp + fp) if tp + fp else 1.0
    recall = tp / (tp + fn) if tp + fn else 1.0
    f1 = 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0
    return {"tp": tp, "fp": fp, "fn": fn, "precision": precision, "recall": recall, "f1": f1}


def f1_at_iou(pred_boxes_per_image: Sequence, target_boxes_per_image: Sequence, iou: float = 0.5) -> float:
    """Detection F1 over a dataset at the IoU threshold; see `detection_counts`."""
    return detection_counts(pred_boxes_per_image, target_boxes_per_image, iou)["f1"]
