"""Scene model: seeded scene sampling and ground-truth records."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterable

import numpy as np

from .config import CLASS_SIZES, CLASS_TRAVEL, WorldConfig

VEHICLES = ("car", "bus", "truck", "bicycle")  # classes that use the road lanes
MAX_OVERLAP = 0.15  # largest share of the smaller box another object may cover, in any frame


# ----------------------------------------------------------------------------- truth records
@dataclass
class ObjectTruth:
    """One object in one frame. `box` is (x1, y1, x2, y2), x2/y2 exclusive, clipped to the frame;
    it is the whole object even where another object hides part of it."""
    track_id: int
    cls: str
    color: str
    box: tuple[int, int, int, int]
    direction: str | None = None  # clips only: dominant motion of the track over the clip

    def to_dict(self) -> dict[str, Any]:
        return {"track_id": self.track_id, "cls": self.cls, "color": self.color,
                "box": list(self.box), "direction": self.direction}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ObjectTruth":
        return cls(int(d["track_id"]), d["cls"], d["color"], tuple(int(v) for v in d["box"]),
                   d.get("direction"))


@dataclass
class FrameTruth:
    """Objects visible (non-empty clipped box) in one frame, by track id."""
    frame: int
    objects: list[ObjectTruth]

    def to_dict(self) -> dict[str, Any]:
        return {"frame": self.frame, "objects": [o.to_dict() for o in self.objects]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FrameTruth":
        return cls(int(d["frame"]), [ObjectTruth.from_dict(o) for o in d["objects"]])


def count_objects(objects: Iterable[ObjectTruth], classes: Iterable[str]) -> dict[str, int]:
    counts = {c: 0 for c in classes}
    for o in objects:
        counts[o.cls] += 1
    return counts


@dataclass
class ImageTruth:
    """Ground truth of one still image; `counts` has every configured class, zeros included."""
    index: int
    seed: int
    width: int
    height: int
    objects: list[ObjectTruth]
    counts: dict[str, int]
    kind: ClassVar[str] = "image"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "index": self.index, "seed": self.seed, "width": self.width,
                "height": self.height, "objects": [o.to_dict() for o in self.objects],
                "counts": dict(self.counts)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ImageTruth":
        return cls(d["index"], d["seed"], d["width"], d["height"],
                   [ObjectTruth.from_dict(o) for o in d["objects"]], dict(d["counts"]))


@dataclass
class ClipTruth:
    """Ground truth of one clip.

    `frames[t]` lists the objects visible in frame t. `directions[track_id]` is the track's
    dominant motion: the axis of the larger displacement of its (unclipped) box between the
    first and last frame, or "stationary" when it does not move. `counts` counts the distinct
    tracks visible in the middle frame (`frames[len(frames) // 2]`), which is also what
    `objects` returns, so questions about a clip refer to that frame. Objects are placed so that
    at least 60% of each stays in view in every frame, hence every track is in every frame.
    """
    index: int
    seed: int
    width: int
    height: int
    fps: int
    frames: list[FrameTruth]
    directions: dict[int, str]
    counts: dict[str, int]
    kind: ClassVar[str] = "clip"

    @property
    def middle(self) -> int:
        return len(self.frames) // 2

    @property
    def objects(self) -> list[ObjectTruth]:
        return self.frames[self.middle].objects

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "index": self.index, "seed": self.seed, "width": self.width,
                "height": self.height, "fps": self.fps, "frames": [f.to_dict() for f in self.frames],
                "directions": {str(k): v for k, v in self.directions.items()},
                "counts": dict(self.counts)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ClipTruth":
        return cls(d["index"], d["seed"], d["width"], d["height"], d["fps"],
                   [FrameTruth.from_dict(f) for f in d["frames"]],
                   {int(k): v for k, v in d["directions"].items()}, dict(d["counts"]))


def truth_from_dict(d: dict[str, Any]) -> ImageTruth | ClipTruth:
    kinds = {"image": ImageTruth, "clip": ClipTruth}
    if d.get("kind") not in kinds:
        raise ValueError(f"truth kind must be one of {sorted(kinds)}, got {d.get('kind')!r}")
    return kinds[d["kind"]].from_dict(d)


# ----------------------------------------------------------------------------- scene sampling
@dataclass
class Lane:
    axis: str                 # "h": travel along x, "v": travel along y
    coord: float              # h: ground line (object bottom) y; v: centre x
    sign: int                 # +1 right/down, -1 left/up, 0 either way (sidewalks)
    classes: tuple[str, ...]
    rotate: bool = False      # vehicles on vertical lanes are drawn turned by 90 degrees


@dataclass
class Layout:
    road: tuple[int, int]     # horizontal road rows y0, y1
    vroad: tuple[int, int]    # vertical road columns x0, x1
    sidewalk: int
    lanes: list[Lane]
    trees: list[tuple[int, int, int]]  # x, y, radius
    grass_tint: int


@dataclass
class Track:
    track_id: int
    cls: str
    color: str
    sprite_size: tuple[int, int]  # (w, h) of the side view before rotation
    heading: str                  # way the sprite faces: left/right/up/down
    rotate: bool
    x0: float
    y0: float
    vx: float                     # px per frame
    vy: float

    def boxes(self, n_frames: int) -> np.ndarray:
        """Unclipped int boxes (n_frames, 4) of the full sprite in every frame."""
        w, h = self.sprite_size[::-1] if self.rotate else self.sprite_size
        t = np.arange(n_frames)
        x, y = np.round(self.x0 + self.vx * t), np.round(self.y0 + self.vy * t)
        return np.stack([x, y, x + w, y + h], 1).astype(np.int64)


@dataclass
class Scene:
    layout: Layout
    tracks: list[Track]
    n_frames: int


def sample_layout(cfg: WorldConfig, rng: np.random.Generator) -> Layout:
    W, H, s = cfg.width, cfg.height, min(cfg.width, cfg.height) / 224
    lane_h, lane_w, sw = 34 * s, 30 * s, max(6, round(13 * s))
    cy, cx = rng.uniform(0.5, 0.6) * H, rng.uniform(0.2, 0.8) * W
    y0, y1, x0, x1 = round(cy - lane_h), round(cy + lane_h), round(cx - lane_w), round(cx + lane_w)
    walkers = ("person", "bicycle")
    lanes = [Lane("h", y0 + 0.9 * lane_h, -1, VEHICLES), Lane("h", y1 - 0.08 * lane_h, 1, VEHICLES),
             Lane("h", y0 - 2 * s, 0, walkers), Lane("h", y1 + sw - 1, 0, walkers),
             Lane("v", cx - lane_w / 2, 1, VEHICLES, True), Lane("v", cx + lane_w / 2, -1, VEHICLES, True),
             Lane("v", x0 - sw / 2, 0, ("person",)), Lane("v", x1 + sw / 2, 0, ("person",))]
    trees: list[tuple[int, int, int]] = []
    for _ in range(int(rng.integers(2, 7))):  # trees only on grass, clear of roads and sidewalks
        r = int(rng.uniform(7, 13) * s)
        x, y = int(rng.uniform(0, W)), int(rng.uniform(0, H))
        if (y + r < y0 - sw - 22 * s or y - r > y1 + sw) and not x0 - sw - r < x < x1 + sw + r:
            trees.append((x, y, r))
    return Layout((y0, y1), (x0, x1), sw, lanes, trees, int(rng.integers(-15, 16)))


def _sample_track(cfg: WorldConfig, rng: np.random.Generator, layout: Layout, tid: int,
                  n_frames: int) -> Track:
    s = min(cfg.width, cfg.height) / 224
    cls = cfg.classes[int(rng.integers(len(cfg.classes)))]
    color = cfg.colors[int(rng.integers(len(cfg.colors)))]
    lanes = [lane for lane in layout.lanes if cls in lane.classes]
    lane = lanes[int(rng.integers(len(lanes)))]
    sign = lane.sign or (1 if rng.random() < 0.5 else -1)
    k = rng.uniform(0.9, 1.1)
    sw, sh = (max(3, round(v * s * k)) for v in CLASS_SIZES[cls])
    w, h = (sh, sw) if lane.rotate else (sw, sh)
    moving = n_frames > 1 and rng.random() >= cfg.stationary_prob
    travel = sign * rng.uniform(*CLASS_TRAVEL[cls]) * s if moving else 0.0
    # start where at least 60% of the object stays in view on both ends of its path
    size, extent = (w, cfg.width) if lane.axis == "h" else (h, cfg.height)
    lo = max(-0.4 * size, -0.4 * size - travel)
    hi = min(extent - 0.6 * size, extent - 0.6 * size - travel)
    along = rng.uniform(lo, hi)
    step = travel / (n_frames - 1) if n_frames > 1 else 0.0
    jitter = rng.uniform(-1.5, 1.5) * s
    if lane.axis == "h":
        heading = "right" if sign > 0 else "left"
        return Track(tid, cls, color, (sw, sh), heading, False, along, lane.coord - h + jitter, step, 0.0)
    heading = "down" if sign > 0 else "up"
    return Track(tid, cls, color, (sw, sh), heading, lane.rotate, lane.coord - w / 2 + jitter,
                 along, 0.0, step)


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Largest share of the smaller box covered by the other, over all frames."""
    iw = np.clip(np.minimum(a[:, 2], b[:, 2]) - np.maximum(a[:, 0], b[:, 0]), 0, None)
    ih = np.clip(np.minimum(a[:, 3], b[:, 3]) - np.maximum(a[:, 1], b[:, 1]), 0, None)
    area = lambda q: (q[:, 2] - q[:, 0]) * (q[:, 3] - q[:, 1])  # noqa: E731
    return float(np.max(iw * ih / np.minimum(area(a), area(b))))


def sample_scene(cfg: WorldConfig, rng: np.random.Generator, n_frames: int) -> Scene:
    """Lay out the road and place up to a random number of objects that never overlap much."""
    layout = sample_layout(cfg, rng)
    n = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
    tracks: list[Track] = []
    placed: list[np.ndarray] = []
    for _ in range(n):
        for _attempt in range(40):  # crowded scenes may keep fewer than n objects
            tr = _sample_track(cfg, rng, layout, len(tracks), n_frames)
            bx = tr.boxes(n_frames)
            if all(_overlap(bx, p) <= MAX_OVERLAP for p in placed):
                tracks.append(tr)
                placed.append(bx)
                break
    return Scene(layout, tracks, n_frames)


def _clip_box(b: np.ndarray, W: int, H: int) -> tuple[int, int, int, int]:
    return (int(min(max(b[0], 0), W)), int(min(max(b[1], 0), H)),
            int(min(max(b[2], 0), W)), int(min(max(b[3], 0), H)))


def direction_of(dx: float, dy: float) -> str:
    if dx == 0 and dy == 0:
        return "stationary"
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


def scene_objects(cfg: WorldConfig, scene: Scene, with_direction: bool) -> list[list[ObjectTruth]]:
    """Per-frame lists of visible objects."""
    frames: list[list[ObjectTruth]] = [[] for _ in range(scene.n_frames)]
    for tr in scene.tracks:
        bx = tr.boxes(scene.n_frames)
        d = direction_of(*(bx[-1, :2] - bx[0, :2])) if with_direction else None
        for t in range(scene.n_frames):
            box = _clip_box(bx[t], cfg.width, cfg.height)
            if box[2] > box[0] and box[3] > box[1]:
                frames[t].append(ObjectTruth(tr.track_id, tr.cls, tr.color, box, d))
    return frames


def image_truth(cfg: WorldConfig, index: int, scene: Scene) -> ImageTruth:
    objs = scene_objects(cfg, scene, False)[0]
    return ImageTruth(index, cfg.seed, cfg.width, cfg.height, objs, count_objects(objs, cfg.classes))


def clip_truth(cfg: WorldConfig, index: int, scene: Scene) -> ClipTruth:
    per_frame = scene_objects(cfg, scene, True)
    frames = [FrameTruth(t, objs) for t, objs in enumerate(per_frame)]
    directions = {o.track_id: o.direction for f in per_frame for o in f}
    directions = {k: directions[k] for k in sorted(directions)}
    mid = frames[len(frames) // 2].objects
    return ClipTruth(index, cfg.seed, cfg.width, cfg.height, cfg.fps, frames, directions,
                     count_objects(mid, cfg.classes))
