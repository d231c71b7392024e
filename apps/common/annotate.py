"""Annotated output: the frames of processed chunks with predicted boxes, counts and labels drawn
(and, when asked, the ground-truth boxes), written as a video OpenCV reads back.

The writer opens on the first chunk (its size and the stream's sampled rate) and tries mp4v in
.mp4, then MJPG in .avi, like `world.write_video`; `Annotator.path` is the file written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import cv2
import numpy as np

from world.io import CODECS

PRED_COLOR = (0, 255, 0)  # BGR
TRUTH_COLOR = (255, 255, 255)
TEXT_COLOR = (0, 255, 255)


def draw_boxes(image: np.ndarray, boxes: Iterable[Sequence[float]], color=PRED_COLOR,
               labels: Sequence[str] | None = None, thickness: int = 1) -> np.ndarray:
    """Draw (x1, y1, x2, y2) pixel boxes on a BGR image in place; returns the image."""
    h, w = image.shape[:2]
    for i, box in enumerate(boxes):
        x1, y1, x2, y2 = (int(round(v)) for v in box)
        x1, x2 = min(max(x1, 0), w - 1), min(max(x2 - 1, 0), w - 1)
        y1, y2 = min(max(y1, 0), h - 1), min(max(y2 - 1, 0), h - 1)
        cv2.rectangle(image, (x1, y1), (max(x1, x2), max(y1, y2)), color, thickness)
        if labels is not None and i < len(labels) and labels[i]:
            cv2.putText(image, labels[i], (x1, max(8, y1 - 2)), cv2.FONT_HERSHEY_SIMPLEX, 0.3, color, 1, cv2.LINE_AA)
    return image


def draw_banner(image: np.ndarray, lines: Sequence[str]) -> np.ndarray:
    """Text lines on a dark band at the top of a BGR image, in place."""
    scale = max(0.25, min(0.5, image.shape[1] / 640))
    step = int(round(22 * scale)) + 2
    band = min(image.shape[0], step * len(lines) + 2)
    image[:band] = (image[:band] * 0.35).astype(image.dtype)
    for i, line in enumerate(lines):
        cv2.putText(image, line, (2, step * (i + 1) - 3), cv2.FONT_HERSHEY_SIMPLEX, scale, TEXT_COLOR, 1, cv2.LINE_AA)
    return image


class Annotator:
    def __init__(self, path: str | os.PathLike, fps: float):
        if not fps > 0:
            raise ValueError(f"Annotator: fps must be positive, got {fps!r}")
        self.requested, self.fps = Path(path), float(fps)
        self.path: Path | None = None
        self.frames_written = 0
        self._writer = None
        self._size: tuple[int, int] | None = None

    def _open(self, width: int, height: int) -> None:
        self.requested.parent.mkdir(parents=True, exist_ok=True)
        tried = []
        for suffix, fourcc in CODECS:
            target = self.requested.with_suffix(suffix)
            writer = cv2.VideoWriter(str(target), cv2.VideoWriter_fourcc(*fourcc), self.fps, (width, height))
            if writer.isOpened():
                self._writer, self.path, self._size = writer, target, (width, height)
                return
            writer.release()
            tried.append(f"{fourcc} in {target.name}")
        raise RuntimeError(f"could not write annotated video {self.requested}: OpenCV cannot encode {', '.join(tried)}")

    def write(self, frames: Sequence[np.ndarray], lines: Sequence[str], boxes: Sequence[Sequence[float]] = (),
              truth_boxes: Sequence[Sequence[float]] = (), box_labels: Sequence[str] | None = None) -> None:
        """Draw one chunk's results on copies of its BGR frames and append them to the video."""
        if not frames:
            return
        h, w = frames[0].shape[:2]
        if self._writer is None:
            # video encoders need even sizes; a 1-pixel crop is invisible, a failed write is not
            self._open(w - w % 2, h - h % 2)
        width, height = self._size
        for frame in frames:
            out = frame.copy()
            draw_boxes(out, truth_boxes, TRUTH_COLOR)
            draw_boxes(out, boxes, PRED_COLOR, box_labels)
            draw_banner(out, lines)
            if out.shape[:2] != (height, width):
                out = cv2.resize(out, (width, height)) if abs(out.shape[1] - width) > 1 or \
                    abs(out.shape[0] - height) > 1 else out[:height, :width]
            self._writer.write(np.ascontiguousarray(out))
            self.frames_written += 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.release()
            self._writer = None
