"""Results drawn on their images: predicted boxes in green, the known box in white, and the
question and answer on a band at the top; saved as PNG next to the results."""

from __future__ import annotations

import re
from pathlib import Path

import cv2
import numpy as np

from apps.common.annotate import PRED_COLOR, TRUTH_COLOR, draw_banner, draw_boxes
from apps.common.answers import Prediction


def draw_result(image: np.ndarray, query, pred: Prediction, out_dir: Path) -> Path:
    """Draw one result on a copy of the BGR image and write it; returns the file written."""
    out = image.copy()
    if query.box is not None:
        draw_boxes(out, [query.box], TRUTH_COLOR)
    draw_boxes(out, pred.boxes, PRED_COLOR)
    answer = pred.text.strip().replace("\n", " ")[:40] or "(no text)"
    draw_banner(out, [query.question[:48], f"-> {answer}"])
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(query.image).stem)
    path = out_dir / f"{query.id or 'q'}_{stem}.png"
    if not cv2.imwrite(str(path), out):
        raise IOError(f"cannot write {path}")
    return path
