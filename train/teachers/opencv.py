"""OpenCV teachers: colour segmentation of objects against the road, and motion direction of clips.

`ColorBlobDetector` finds objects of chosen named colours by HSV thresholds, joins each object's
pieces with a morphological closing, and names the class from the blob's shape (long side,
aspect) the way a hand-tuned traffic-camera script would. Its default colours are those that
nothing in the scene but objects has (the road is grey, grass green, lane marks yellow/white).

`MotionDirection` takes a clip: dense optical flow (Farneback) between evenly spaced frames,
the pixels that move form one swept region per object, and the mean flow of the largest
region gives the direction of the largest moving object (a median background fails here: a
bus is longer than the distance it travels in a clip, so it would become background).
"""
from __future__ import annotations

from typing import Sequence

import cv2
import numpy as np

from world import COLORS, DIRECTIONS

from .base import DETECTOR_TARGETS, Detection, Label, Teacher, TeacherError, check_frame


def _hsv_of(bgr: tuple[int, int, int]) -> tuple[int, int, int]:
    return tuple(int(v) for v in cv2.cvtColor(np.uint8([[bgr]]), cv2.COLOR_BGR2HSV)[0, 0])


class ColorBlobDetector(Teacher):
    """Objects of the named `colors` (keys of world.COLORS) by colour segmentation."""

    kind = "opencv"
    targets = DETECTOR_TARGETS | {"color"}
    is_detector = True
    classes = ("car", "bus", "truck", "person", "bicycle")

    def __init__(self, colors: Sequence[str] = ("red", "blue"), name: str = "opencv_color",
                 hue_tol: int = 8, min_area: int = 12):
        bad = [c for c in colors if c not in COLORS]
        if not colors or bad:
            raise TeacherError(f"ColorBlobDetector colors must be names from {sorted(COLORS)}, got {list(colors)}")
        self.colors, self.name, self.min_area = tuple(colors), name, min_area
        self.ranges = {}
        for c in self.colors:
            h, s, v = _hsv_of(COLORS[c])
            if s < 60:  # white / black: no usable hue, go by brightness alone
                lo, hi = (0, 0, max(0, v - 25)), (180, 60, min(255, v + 25))
                self.ranges[c] = [(lo, hi)]
            else:  # hue wraps at 180 (red)
                s_lo, v_lo = int(s * 0.45), int(v * 0.45)
                lo, hi = h - hue_tol, h + hue_tol
                parts = [(max(lo, 0), min(hi, 179))]
                if lo < 0:
                    parts.append((180 + lo, 179))
                if hi > 179:
                    parts.append((0, hi - 180))
                self.ranges[c] = [((a, s_lo, v_lo), (b, 255, 255)) for a, b in parts]
        self.detail = (f"HSV colour segmentation of {', '.join(self.colors)} objects (hue +-{hue_tol}), "
                       f"closing 5x5, class from blob shape")

    def mask(self, frame: np.ndarray, color: str) -> np.ndarray:
        hsv = cv2.cvtColor(check_frame(frame), cv2.COLOR_RGB2HSV)
        m = np.zeros(hsv.shape[:2], np.uint8)
        for lo, hi in self.ranges[color]:
            m |= cv2.inRange(hsv, np.array(lo, np.uint8), np.array(hi, np.uint8))
        m = cv2.morphologyEx(m, cv2.MORPH_OPEN, np.ones((2, 2), np.uint8))  # sensor-noise specks
        return cv2.morphologyEx(m, cv2.MORPH_CLOSE, np.ones((5, 5), np.uint8))  # truck cab + trailer

    def detect(self, frame: np.ndarray) -> list[Detection]:
        H, W = frame.shape[:2]
        scale = min(H, W) / 224  # the world's object sizes are given at 224 px
        out = []
        for color in self.colors:
            n, _, stats, _ = cv2.connectedComponentsWithStats(self.mask(frame, color))
            for x, y, w, h, area in stats[1:]:
                if area < self.min_area * scale * scale:
                    continue
                fill = area / float(w * h)
                cls, box = self._shape_class(float(x), float(y), float(w), float(h), fill, scale, W, H)
                out.append(Detection(cls, round(min(1.0, 0.5 + fill / 2), 3), box, color))
        return out

    @staticmethod
    def _shape_class(x, y, w, h, fill, s, W, H) -> tuple[str, tuple[float, float, float, float]]:
        """Class from the blob's long side and fill (measured on world renders). People and
        bicycles show their colour on part of the sprite only (shirt and arms; the frame), so
        their box is grown to the whole sprite."""
        long_side, upright = max(w, h) / s, h > w
        if long_side >= 72 or (long_side >= 62 and fill < 0.7):
            return "bus", (x, y, x + w, y + h)  # windows make a bus's blob less full than a trailer
        if long_side >= 50:
            return "truck", (x, y, x + w, y + h)
        if long_side >= 26:
            return "car", (x, y, x + w, y + h)
        if long_side < 11.5:  # shirt and arms, ~0.4 of the person's height from 0.22 down
            full_h = h / 0.4
            y1 = y - 0.22 * full_h
            return "person", (x, max(0.0, y1), x + w, min(float(H), y1 + full_h))
        if upright:  # bicycle turned onto a vertical lane: frame centred, wheels around it
            full_w, full_h = w / 0.75, h / 0.65
            x1, y1 = x - (full_w - w) / 2, y - (full_h - h) / 2
        else:        # side view: the frame is the top 3/4, the wheels reach below it
            full_w, full_h = w / 0.65, h / 0.75
            x1, y1 = x - (full_w - w) / 2, y
        return "bicycle", (max(0.0, x1), max(0.0, y1), min(float(W), x1 + full_w), min(float(H), y1 + full_h))


class MotionDirection(Teacher):
    """Direction of the largest moving object of a clip: left/right/up/down, or stationary."""

    kind = "opencv"
    targets = frozenset({"direction"})
    labels = tuple(DIRECTIONS)

    def __init__(self, name: str = "opencv_motion", sample_frames: int = 8, min_flow: float = 1.0,
                 min_steps: int = 2, min_area: int = 120, min_shift: float = 0.3):
        if sample_frames < 2 or not 1 <= min_steps < sample_frames:
            raise TeacherError(f"MotionDirection needs sample_frames >= 2 and 1 <= min_steps < sample_frames, "
                               f"got {sample_frames} and {min_steps}")
        self.name, self.sample_frames, self.min_flow, self.min_steps = name, sample_frames, min_flow, min_steps
        self.min_area, self.min_shift = min_area, min_shift  # min_area in px at 224 x 224
        self.detail = (f"Farneback optical flow between {sample_frames} evenly spaced frames; the largest "
                       f"region moving > {min_flow} px/step in >= {min_steps} steps; its mean flow's dominant axis")

    def flow(self, clip: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Summed flow of moving pixels [H, W, 2] (px per step) and how many steps each moved [H, W]."""
        pick = np.linspace(0, len(clip) - 1, min(self.sample_frames, len(clip))).round().astype(int)
        grey = [cv2.cvtColor(check_frame(clip[i], "clip frame"), cv2.COLOR_RGB2GRAY) for i in pick]
        total = np.zeros(grey[0].shape + (2,), np.float32)
        steps = np.zeros(grey[0].shape, np.float32)
        for a, b in zip(grey[:-1], grey[1:]):
            f = cv2.calcOpticalFlowFarneback(a, b, None, 0.5, 3, 15, 3, 5, 1.2, 0)  # [H, W, 2]: dx, dy
            moving = np.linalg.norm(f, axis=2) > self.min_flow
            total += f * moving[..., None]
            steps += moving
        return total, steps

    def direction(self, clip: Sequence[np.ndarray]) -> Label:
        if len(clip) < 2:
            raise TeacherError(f"MotionDirection needs a clip of >= 2 frames, got {len(clip)}")
        total, steps = self.flow(clip)
        # The region an object sweeps over the clip. Video compression makes flow flicker for a
        # step here and there; real motion persists over several steps. Opening drops speckle.
        region = cv2.morphologyEx((steps >= self.min_steps).astype(np.uint8), cv2.MORPH_OPEN, np.ones((3, 3), np.uint8))
        n, labels, stats, _ = cv2.connectedComponentsWithStats(region)
        areas = stats[1:, cv2.CC_STAT_AREA]
        if n < 2 or areas.max() < self.min_area * total.shape[0] * total.shape[1] / 224 ** 2:
            return Label("stationary")
        sel = labels == 1 + int(areas.argmax())
        dx, dy = total[sel].sum(0) / max(float(steps[sel].sum()), 1.0)  # mean flow while moving
        if max(abs(dx), abs(dy)) < self.min_shift:
            return Label("stationary")
        if abs(dx) >= abs(dy):
            return Label("right" if dx > 0 else "left")
        return Label("down" if dy > 0 else "up")
