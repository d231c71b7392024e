"""The synthetic world as a distillation source (the default of every domain).

`prepare_worlds` writes one world per distinct world config with as many images and clips as its
largest domain needs; `WorldSource` lists a domain's items of it (PNG images, clips as real .mp4
files the dataset references by path) and gives the teacher their frames, truth and QA pairs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

from world import WorldIndex, WorldItem, write_world

from .distill_sources import Item
from .distill_spec import DistillJob, DomainError, DomainSpec, world_key
from .teachers import Sample


def prepare_worlds(specs: list[DomainSpec], job: DistillJob) -> dict[str, WorldIndex]:
    """Writes (or finishes) one world per distinct world config, with as many images and clips
    as its largest domain needs; returns domain name -> world."""
    need: dict[str, list] = {}
    for s in specs:
        cfg = s.world_config()
        entry = need.setdefault(world_key(cfg), [cfg, 0, 0])
        entry[1 if s.media == "image" else 2] = max(entry[1 if s.media == "image" else 2], s.size)
    worlds = {key: write_world(cfg, Path(job.world_dir) / key, n_images=n_img, n_clips=n_clip,
                               progress=job.progress, workers=job.world_workers)
              for key, (cfg, n_img, n_clip) in need.items()}
    return {s.name: worlds[world_key(s.world_config())] for s in specs}


def _rgb(item: WorldItem) -> list[np.ndarray]:
    media = item.load()  # BGR, as OpenCV reads it
    frames = media if isinstance(media, list) else [media]
    return [np.ascontiguousarray(f[..., ::-1]) for f in frames]


def _qa(item: WorldItem) -> list[tuple[str, str]]:
    return [(q.question, q.answer) for q in item.qa]


class WorldSource:
    """The first `spec.size` images or clips of a written world."""

    classes = labels = None

    def __init__(self, world: WorldIndex, spec: DomainSpec):
        self.world, self.media = world, spec.media
        worlds_items = world.images if spec.media == "image" else world.clips
        if len(worlds_items) < spec.size:
            raise DomainError(f"domain {spec.name!r}: world {world.root} has {len(worlds_items)} {spec.media}s, "
                              f"needs {spec.size}")
        self.items = [Item(f"{it.kind}-{it.index:06d}", it.kind, it.truth, image_file=it.path,
                           video=str(it.path.resolve()) if it.kind == "clip" else "",
                           n_frames=world.config.clip_frames, extra={"item": it})
                      for it in worlds_items[:spec.size]]
        self.size = (world.config.width, world.config.height)

    def samples(self, items: list[Item]) -> Iterator[Sample]:
        for it in items:
            w = it.extra["item"]
            yield Sample(it.id, w.kind, _rgb(w), w.truth, _qa(w))

    def record(self) -> dict[str, Any]:
        return {"kind": "world", "dir": str(self.world.root.resolve()), "seed": self.world.config.seed}


__all__ = ["prepare_worlds", "WorldSource"]
