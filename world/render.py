"""OpenCV rendering of sampled scenes: road background, object sprites, frames and overlays."""
from __future__ import annotations

from typing import Callable, Iterable

import cv2
import numpy as np

from .config import CLIP_KIND, COLORS, IMAGE_KIND, WorldConfig, item_rng
from .scene import (ClipTruth, ImageTruth, Layout, ObjectTruth, Scene, Track, clip_truth, image_truth,
                    sample_scene)

SS = 4  # sprites are drawn 4x larger and shrunk, which gives smooth edges and a soft alpha mask
GLASS, TYRE, HUB, SKIN, DARK = (225, 195, 150), (25, 25, 25), (150, 150, 150), (140, 175, 215), (55, 50, 45)
ROAD, WALK, LINE, EDGE = (92, 92, 92), (175, 178, 180), (40, 200, 230), (235, 235, 235)


class _Pen:
    """Draws on a supersampled sprite and its mask at once; coordinates are fractions of w/h."""

    def __init__(self, w: int, h: int):
        self.w, self.h = w, h
        self.img = np.zeros((h * SS, w * SS, 3), np.uint8)
        self.mask = np.zeros((h * SS, w * SS), np.uint8)

    def _p(self, fx: float, fy: float) -> tuple[int, int]:
        return round(fx * (self.w * SS - 1)), round(fy * (self.h * SS - 1))

    def _both(self, fn: Callable, *args, color, **kw) -> None:
        fn(self.img, *args, color, **kw)
        fn(self.mask, *args, 255, **kw)

    def rect(self, x0, y0, x1, y1, color) -> None:
        self._both(cv2.rectangle, self._p(x0, y0), self._p(x1, y1), color=color, thickness=-1)

    def poly(self, pts, color) -> None:
        arr = np.array([self._p(x, y) for x, y in pts], np.int32)
        self._both(cv2.fillPoly, [arr], color=color)

    def circle(self, x, y, r, color, thick: float = 0) -> None:
        t = max(1, round(thick * self.h * SS)) if thick else -1
        self._both(cv2.circle, self._p(x, y), round(r * self.h * SS), color=color, thickness=t)

    def line(self, x0, y0, x1, y1, color, thick: float) -> None:
        self._both(cv2.line, self._p(x0, y0), self._p(x1, y1), color=color,
                   thickness=max(1, round(thick * self.h * SS)))

    def wheel(self, x, y, r) -> None:
        self.circle(x, y, r, TYRE)
        self.circle(x, y, r * 0.45, HUB)


def _shade(c, k: float) -> tuple[int, int, int]:
    return tuple(int(min(255, max(0, v * k + (30 if k > 1 else 0)))) for v in c)


def _car(p: _Pen, c) -> None:
    p.poly([(0.17, 0.46), (0.3, 0.0), (0.66, 0.0), (0.82, 0.46)], c)  # cabin
    p.rect(0, 0.42, 1, 0.82, c)
    p.poly([(0.25, 0.44), (0.33, 0.1), (0.46, 0.1), (0.46, 0.44)], GLASS)
    p.poly([(0.5, 0.44), (0.5, 0.1), (0.63, 0.1), (0.75, 0.44)], GLASS)
    p.rect(0.0, 0.7, 1.0, 0.76, _shade(c, 0.6))
    p.rect(0.95, 0.5, 1.0, 0.62, (120, 230, 250))  # headlight marks the front
    p.rect(0.0, 0.5, 0.03, 0.62, (30, 30, 200))
    p.wheel(0.22, 0.78, 0.22)
    p.wheel(0.78, 0.78, 0.22)


def _bus(p: _Pen, c) -> None:
    p.rect(0, 0, 1, 0.86, c)
    for x in np.arange(0.04, 0.82, 0.1):
        p.rect(x, 0.12, x + 0.075, 0.46, GLASS)
    p.rect(0.85, 0.12, 0.92, 0.8, DARK)  # door
    p.rect(0.95, 0.08, 1.0, 0.5, GLASS)
    p.rect(0, 0.56, 0.84, 0.62, _shade(c, 0.6))
    p.wheel(0.15, 0.83, 0.17)
    p.wheel(0.8, 0.83, 0.17)


def _truck(p: _Pen, c) -> None:
    p.rect(0, 0, 0.69, 0.78, c)  # trailer
    p.rect(0.02, 0.05, 0.67, 0.73, _shade(c, 1.12))
    p.rect(0, 0.7, 1, 0.8, DARK)  # chassis links trailer and cab
    p.poly([(0.73, 0.8), (0.73, 0.22), (0.89, 0.22), (1.0, 0.48), (1.0, 0.8)], c)
    p.poly([(0.76, 0.28), (0.87, 0.28), (0.95, 0.48), (0.76, 0.48)], GLASS)
    for x in (0.11, 0.26, 0.86):
        p.wheel(x, 0.83, 0.17)


def _person(p: _Pen, c) -> None:
    p.line(0.38, 0.58, 0.28, 0.99, DARK, 0.09)  # legs
    p.line(0.62, 0.58, 0.72, 0.99, DARK, 0.09)
    p.line(0.22, 0.3, 0.04, 0.58, c, 0.07)  # arms
    p.line(0.78, 0.3, 0.96, 0.58, c, 0.07)
    p.rect(0.2, 0.24, 0.8, 0.62, c)
    p.circle(0.5, 0.12, 0.115, SKIN)


def _bicycle(p: _Pen, c) -> None:
    p.circle(0.22, 0.65, 0.33, TYRE, 0.09)
    p.circle(0.78, 0.65, 0.33, TYRE, 0.09)
    rear, bb, seat, head, front = (0.22, 0.65), (0.47, 0.67), (0.4, 0.2), (0.7, 0.18), (0.78, 0.65)
    for a, b in ((rear, bb), (bb, seat), (seat, rear), (seat, head), (head, bb), (head, front)):
        p.line(*a, *b, c, 0.11)
    p.line(0.32, 0.03, 0.46, 0.03, TYRE, 0.1)  # saddle
    p.line(0.64, 0.03, 0.76, 0.03, TYRE, 0.1)  # handlebar
    p.line(0.7, 0.18, 0.7, 0.03, c, 0.09)


SPRITES: dict[str, Callable[[_Pen, tuple], None]] = {
    "car": _car, "bus": _bus, "truck": _truck, "person": _person, "bicycle": _bicycle}


def make_sprite(track: Track) -> tuple[np.ndarray, np.ndarray]:
    """Premultiplied BGR float sprite and alpha (h, w) in the track's on-screen orientation."""
    w, h = track.sprite_size
    pen = _Pen(w, h)
    SPRITES[track.cls](pen, COLORS[track.color])
    img = cv2.resize(pen.img, (w, h), interpolation=cv2.INTER_AREA).astype(np.float32)
    alpha = cv2.resize(pen.mask, (w, h), interpolation=cv2.INTER_AREA).astype(np.float32) / 255
    if track.rotate:
        code = cv2.ROTATE_90_CLOCKWISE if track.heading == "down" else cv2.ROTATE_90_COUNTERCLOCKWISE
        img, alpha = cv2.rotate(img, code), cv2.rotate(alpha, code)
    elif track.heading == "left":
        img, alpha = img[:, ::-1], alpha[:, ::-1]
    return np.ascontiguousarray(img), np.ascontiguousarray(alpha)


def _dashes(img, a, b, fixed, horizontal, skip, s) -> None:
    """Dashed centre line from a to b, left out inside the crossing `skip` interval."""
    dash, gap = max(3, round(10 * s)), max(2, round(8 * s))
    for u in range(a, b, dash + gap):
        if u + dash < skip[0] or u > skip[1]:
            p0, p1 = ((u, fixed), (u + dash, fixed)) if horizontal else ((fixed, u), (fixed, u + dash))
            cv2.line(img, p0, p1, LINE, max(1, round(2 * s)))


def render_background(cfg: WorldConfig, layout: Layout, rng: np.random.Generator) -> np.ndarray:
    W, H, s = cfg.width, cfg.height, min(cfg.width, cfg.height) / 224
    (y0, y1), (x0, x1), sw = layout.road, layout.vroad, layout.sidewalk
    g = layout.grass_tint
    img = np.empty((H, W, 3), np.uint8)
    img[:] = (60 + g // 2, 140 + g, 85)
    img[max(0, y0 - sw):y1 + sw] = WALK  # max(0, .): a negative start would wrap around
    img[:, max(0, x0 - sw):x1 + sw] = WALK
    img[max(0, y0):y1] = ROAD
    img[:, max(0, x0):x1] = ROAD
    for y in (y0 + 1, y1 - 2):  # solid edge lines, open at the crossing
        cv2.line(img, (0, y), (x0 - sw, y), EDGE, 1)
        cv2.line(img, (x1 + sw, y), (W, y), EDGE, 1)
    _dashes(img, 0, W, (y0 + y1) // 2, True, (x0 - sw, x1 + sw), s)
    _dashes(img, 0, H, (x0 + x1) // 2, False, (y0 - sw, y1 + sw), s)
    stripe = max(2, round(4 * s))
    for xa, xb in ((x0 - sw, x0), (x1, x1 + sw)):  # zebra crossings where sidewalks cross the road
        for y in range(y0 + stripe, y1 - stripe, 2 * stripe):
            img[y:y + stripe, max(0, xa + 1):max(0, xb - 1)] = EDGE
    for x, y, r in layout.trees:
        cv2.circle(img, (x, y), r, (35, 95, 40), -1, cv2.LINE_AA)
        cv2.circle(img, (x - r // 3, y - r // 3), max(1, r // 2), (55, 130, 60), -1, cv2.LINE_AA)
    # static texture: coarse blotches plus fine grain, both fixed for the whole clip
    coarse = cv2.resize(rng.standard_normal((H // 8 + 1, W // 8 + 1), np.float32), (W, H),
                        interpolation=cv2.INTER_LINEAR)
    tex = coarse * 5 + rng.standard_normal((H, W), np.float32) * 3
    return np.clip(img + tex[..., None], 0, 255).astype(np.uint8)


def _compose(bg: np.ndarray, scene: Scene, sprites, t: int, noise: float,
             rng: np.random.Generator) -> np.ndarray:
    frame = bg.astype(np.float32)
    H, W = bg.shape[:2]
    boxes = [tr.boxes(scene.n_frames)[t] for tr in scene.tracks]
    # lower objects are nearer the viewer, so they are drawn last and occlude the others
    for i in sorted(range(len(boxes)), key=lambda i: (boxes[i][3], i)):
        x, y, x2, y2 = (int(v) for v in boxes[i])
        img, alpha = sprites[i]
        cx0, cy0, cx1, cy1 = max(x, 0), max(y, 0), min(x2, W), min(y2, H)
        if cx1 <= cx0 or cy1 <= cy0:
            continue
        a = alpha[cy0 - y:cy1 - y, cx0 - x:cx1 - x, None]
        region = frame[cy0:cy1, cx0:cx1]
        region *= 1 - a
        region += img[cy0 - y:cy1 - y, cx0 - x:cx1 - x]
    if noise > 0:
        frame += rng.standard_normal(frame.shape, np.float32) * noise
    return np.clip(frame + 0.5, 0, 255).astype(np.uint8)


def render_image(cfg: WorldConfig, index: int) -> tuple[np.ndarray, ImageTruth]:
    """Image `index` of the world: HxWx3 uint8 BGR and its truth; depends only on (cfg, index)."""
    rng = item_rng(cfg, IMAGE_KIND, index)
    scene = sample_scene(cfg, rng, 1)
    bg = render_background(cfg, scene.layout, rng)
    frame = _compose(bg, scene, [make_sprite(tr) for tr in scene.tracks], 0, cfg.noise, rng)
    return frame, image_truth(cfg, index, scene)


def render_clip(cfg: WorldConfig, index: int) -> tuple[list[np.ndarray], ClipTruth]:
    """Clip `index`: `cfg.clip_frames` BGR frames and their truth; depends only on (cfg, index)."""
    rng = item_rng(cfg, CLIP_KIND, index)
    scene = sample_scene(cfg, rng, cfg.clip_frames)
    bg = render_background(cfg, scene.layout, rng)
    sprites = [make_sprite(tr) for tr in scene.tracks]
    frames = [_compose(bg, scene, sprites, t, cfg.noise, rng) for t in range(cfg.clip_frames)]
    return frames, clip_truth(cfg, index, scene)


_BOX_COLORS = [(0, 255, 255), (255, 0, 255), (0, 255, 0), (255, 128, 0), (0, 128, 255), (255, 255, 0)]


def draw_truth(frame: np.ndarray, objects: Iterable[ObjectTruth]) -> np.ndarray:
    """Copy of `frame` with each object's box and a "colour class" label drawn on it."""
    out = frame.copy()
    for o in objects:
        x1, y1, x2, y2 = o.box
        c = _BOX_COLORS[o.track_id % len(_BOX_COLORS)]
        cv2.rectangle(out, (x1, y1), (max(x1, x2 - 1), max(y1, y2 - 1)), c, 1)
        label = f"{o.color} {o.cls}" + (f" {o.direction}" if o.direction else "")
        (tw, th), _ = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, 0.3, 1)
        ty = y1 - 2 if y1 - th - 3 >= 0 else min(y2 + th + 2, out.shape[0] - 1)
        cv2.rectangle(out, (x1, ty - th - 1), (x1 + tw, ty + 1), (0, 0, 0), -1)
        cv2.putText(out, label, (x1, ty), cv2.FONT_HERSHEY_SIMPLEX, 0.3, c, 1, cv2.LINE_AA)
    return out
