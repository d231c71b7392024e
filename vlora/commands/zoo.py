"""`vlora zoo`: build the checkpoint directories named in conf/zoo.yaml."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from zoo import build_checkpoint, get_spec

from ..config import to_dataclass


@dataclass
class ZooJob:
    models: list[str]
    dir: str
    seed: int = 0
    dtype: str | None = None
    device: str = "cpu"
    overwrite: bool = False


def build_zoo(job: ZooJob, log=None) -> dict[str, Path]:
    """Builds every model of the job (keeping directories already built alike); returns their paths."""
    for name in job.models:
        get_spec(name)  # fail on a typo before spending time on the others
    paths = {}
    for i, name in enumerate(job.models, 1):
        start = time.perf_counter()
        target = Path(job.dir) / name
        existed = target.exists()
        paths[name] = build_checkpoint(name, target, seed=job.seed, dtype=job.dtype, device=job.device,
                                       overwrite=job.overwrite)
        verb = "kept" if existed and not job.overwrite else "built"
        print(f"[zoo {i}/{len(job.models)}] {name}: {verb} {paths[name]} ({time.perf_counter() - start:.1f} s)",
              file=log or sys.stderr, flush=True)
    return paths


def run(cfg: DictConfig) -> dict[str, Path]:
    return build_zoo(to_dataclass(ZooJob, cfg.zoo, seed=cfg.seed))
