"""`vlora world`: write the synthetic traffic world described by conf/world/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from world import WorldConfig, WorldIndex, write_world

from ..config import to_dataclass


@dataclass
class WorldJob:
    generator: dict
    n_images: int
    n_clips: int
    dir: str


def world_job(cfg: DictConfig) -> tuple[WorldConfig, WorldJob]:
    job = to_dataclass(WorldJob, cfg.world)
    generator = {k: tuple(v) if isinstance(v, list) else v for k, v in job.generator.items()}
    return to_dataclass(WorldConfig, generator), job


def run(cfg: DictConfig) -> WorldIndex:
    world_cfg, job = world_job(cfg)
    return write_world(world_cfg, job.dir, n_images=job.n_images, n_clips=job.n_clips)



