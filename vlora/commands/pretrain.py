"""`vlora pretrain`: the short world pretraining that makes a random-weight zoo model learnable."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from train.pretrain import PretrainConfig, pretrain

from ..config import to_dataclass
from .train import ensure_zoo_model


def pretrain_config(node: DictConfig) -> PretrainConfig:
    values = OmegaConf.to_container(node, resolve=True)
    return to_dataclass(PretrainConfig, {k: v for k, v in values.items() if k not in ("out", "force")})


def run(cfg: DictConfig) -> Path:
    base = ensure_zoo_model(cfg)
    return pretrain(base, cfg.pretrain.out, pretrain_config(cfg.pretrain), force=bool(cfg.pretrain.force))
