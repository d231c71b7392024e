"""Hydra plumbing shared by the entry points: where the configs live and how they are composed.

Hydra stays at the edges: an entry point composes a DictConfig and hands it to a plain
`run(cfg)`, which turns it into dataclasses before calling library code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
PRIMARY_CONFIGS = ("zoo", "world", "demo", "train", "fusion", "serve", "video_analytics",
                   "visual_retrieval", "bench", "tune", "loadtest", "simulate", "teachers", "distill", "offline", "pretrain", "smoke",
                   "diagnose")
T = TypeVar("T")


def compose(config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Composes a primary config the way its command would, for tests and in-process callers."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if config_name not in PRIMARY_CONFIGS:
        raise ValueError(f"unknown config {config_name!r}; primary configs: {PRIMARY_CONFIGS}")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name=config_name):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def hydra_entry(config_name: str, run: Callable[[DictConfig], Any]) -> Callable[[], Any]:
    """An `@hydra.main` function for `config_name` that calls `run(cfg)`."""
    import hydra

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)
    def main(cfg: DictConfig) -> Any:
        if "paths" in cfg:  # before the command imports ultralytics or matplotlib (vlora.home)
            from .home import pin_tool_dirs

            pin_tool_dirs(cfg.paths.home)
        return run(cfg)

    return main


def to_dataclass(cls: type[T], node: DictConfig | dict, **extra: Any) -> T:
    """Builds dataclass `cls` from a config node, naming any key the dataclass does not know."""
    values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    values.update(extra)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; valid fields: {sorted(known)}")
    return cls(**values)
