"""`vlora tune`: the offline tiling search (kernels.search) on this machine's GPU."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from ..config import to_dataclass


def run(cfg: DictConfig):
    import torch

    from kernels.search import SearchJob, run_search

    if not torch.cuda.is_available():
        raise SystemExit("vlora tune profiles kernels on a CUDA GPU; none is available here")
    job = to_dataclass(SearchJob, cfg.tune)
    if job.log:
        Path(job.log).parent.mkdir(parents=True, exist_ok=True)
    return run_search(job)
