"""`calibrate_threshold`: the score threshold at which a trained detect head's F1 is highest.

A detect head reports a box when its score exceeds `HeadConfig.score_threshold`. The default 0.5
says nothing about where a trained head's scores for true boxes lie (a dense head trained with
owner-weighted BCE often scores them well below or above it), and F1 at IoU 0.5 moves by several
points between thresholds. So after training, the head's outputs on (part of) the train split are
decoded at every threshold of a grid and the one with the best F1 is kept in the head's config,
which is saved with the head and used by evaluation and the server. The eval split is left out:
fusion checks each domain's requirement on it.
"""

from __future__ import annotations

from dataclasses import replace

from heads import TaskHead, f1_at_iou

from .data import DomainData
from .evaluate import head_outputs, split_size

GRID = tuple(round(0.05 * k, 2) for k in range(1, 20))  # 0.05 .. 0.95
IOU = 0.5  # the IoU evaluation scores detection at


def calibrate_threshold(vlm, head: TaskHead | None, data: DomainData, split: str = "train", batch_size: int = 32,
                        limit: int | None = 256, grid=GRID) -> dict:
    """Set a detect head's score threshold to the one of `grid` (or its current one) with the best
    F1 at IoU 0.5 on up to `limit` items of `split`; ties go to the threshold nearest the current one.

    Returns {"threshold", "f1", "default_threshold" (the head's threshold before), "default_f1",
    "items", "split"}; {} for other tasks, whose heads are left as they are. The model runs once.
    """
    if data.info.task != "detect" or head is None:
        return {}
    n = split_size(data, split, limit, "calibrate a threshold on")
    current = head.config.score_threshold
    # the current threshold competes too: calibration never makes the head worse on these items
    thresholds = sorted({float(t) for t in grid} | {current})
    for t in thresholds:
        if not 0.0 < t < 1.0:
            raise ValueError(f"calibrate_threshold: grid value {t!r} is not in (0, 1)")
    vlm.model.eval()
    head.eval()
    preds: dict[float, list] = {t: [] for t in thresholds}
    targets: list = []
    for outputs, batch_targets in head_outputs(vlm, head, data, split, n, batch_size):
        for t in thresholds:
            preds[t] += [r.boxes for r in head.decode(outputs, threshold=t)]
        targets += batch_targets
    f1 = {t: float(f1_at_iou(preds[t], targets, IOU)) for t in thresholds}
    best = max(thresholds, key=lambda t: (f1[t], -abs(t - current)))
    # a new config rather than an edit: it is checked again, and a config object shared with
    # another head keeps its value
    head.config = replace(head.config, score_threshold=best)
    return {"threshold": best, "f1": f1[best], "default_threshold": current, "default_f1": f1[current],
            "items": n, "split": split}


def describe(name: str, result: dict) -> str:
    """One log line: `[calibrate] detect_car: threshold 0.35 (train F1 0.81; 0.5 gave 0.78)`."""
    return (f"[calibrate] {name}: threshold {result['threshold']:g} ({result['split']} F1 {result['f1']:.2f}; "
            f"{result['default_threshold']:g} gave {result['default_f1']:.2f})")
