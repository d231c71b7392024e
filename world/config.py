"""World configuration: the named colours and drawable classes, and `WorldConfig`."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

# Named BGR colours; grey is left out so every object stands out from the asphalt.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (40, 40, 215), "green": (50, 165, 40), "blue": (200, 90, 25),
    "yellow": (30, 215, 240), "white": (245, 245, 245), "black": (30, 30, 30),
    "orange": (20, 135, 250), "purple": (150, 45, 125), "pink": (185, 130, 250),
    "cyan": (215, 205, 50), "brown": (40, 75, 125),
}
# Side-view sprite size (w, h) at 224 px and total travel over one clip in px.
CLASS_SIZES: dict[str, tuple[int, int]] = {
    "car": (40, 20), "bus": (72, 28), "truck": (64, 28), "person": (9, 22), "bicycle": (22, 14)}
CLASS_TRAVEL: dict[str, tuple[float, float]] = {
    "car": (25, 60), "bus": (16, 40), "truck": (18, 45), "person": (8, 16), "bicycle": (14, 35)}
DIRECTIONS = ("left", "right", "up", "down", "stationary")
IMAGE_KIND, CLIP_KIND = 0, 1


@dataclass(frozen=True)
class WorldConfig:
    """Everything that determines the generated world; equal configs give equal worlds."""
    seed: int = 0
    width: int = 224
    height: int = 224
    fps: int = 30
    clip_frames: int = 30
    classes: tuple[str, ...] = ("car", "bus", "truck", "person", "bicycle")
    colors: tuple[str, ...] = ("red", "green", "blue", "yellow", "white", "black")
    max_objects: int = 6
    min_objects: int = 0
    noise: float = 2.0  # std of per-frame sensor noise, in grey levels
    stationary_prob: float = 0.25

    def __post_init__(self) -> None:
        object.__setattr__(self, "classes", tuple(self.classes))
        object.__setattr__(self, "colors", tuple(self.colors))
        for name in ("seed", "width", "height", "fps", "clip_frames", "max_objects", "min_objects"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"WorldConfig.{name} must be an int, got {v!r}")
            object.__setattr__(self, name, int(v))  # plain ints keep to_dict JSON-safe
        for name in ("noise", "stationary_prob"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise TypeError(f"WorldConfig.{name} must be a number, got {v!r}")
            object.__setattr__(self, name, float(v))
        for name in ("width", "height"):
            v = getattr(self, name)
            if v < 64 or v % 2:  # the road layout needs room; video encoders need even sizes
                raise ValueError(f"WorldConfig.{name} must be an even number of pixels >= 64, got {v}")
        if self.fps <= 0:
            raise ValueError(f"WorldConfig.fps must be positive, got {self.fps}")
        if self.clip_frames < 2:
            raise ValueError(f"WorldConfig.clip_frames must be >= 2, got {self.clip_frames}")
        for name, known in (("classes", CLASS_SIZES), ("colors", COLORS)):
            vals = getattr(self, name)
            bad = [v for v in vals if v not in known]
            if not vals or bad or len(set(vals)) != len(vals):
                raise ValueError(f"WorldConfig.{name} must be distinct names from {sorted(known)}, "
                                 f"got {list(vals)}" + (f" (unknown: {bad})" if bad else ""))
        if not 0 <= self.min_objects <= self.max_objects:
            raise ValueError(f"WorldConfig.min_objects/max_objects need 0 <= min_objects <= max_objects, "
                             f"got {self.min_objects}/{self.max_objects}")
        if not self.noise >= 0:
            raise ValueError(f"WorldConfig.noise must be >= 0, got {self.noise}")
        if not 0.0 <= self.stationary_prob <= 1.0:
            raise ValueError(f"WorldConfig.stationary_prob must be in [0, 1], got {self.stationary_prob}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WorldConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown WorldConfig fields {unknown}; valid fields: {sorted(names)}")
        return cls(**d)


def item_rng(cfg: WorldConfig, kind_code: int, index: int) -> np.random.Generator:
    """Per-item stream, so item i never depends on which other items were made."""
    return np.random.default_rng([cfg.seed, kind_code, index])
