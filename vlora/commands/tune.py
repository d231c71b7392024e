"""`vlora tune`: the offline tiling search (vlora_kernels.search) on this machine's GPU."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from zoo import get_spec

from ..config import to_dataclass


def projection_layouts(model: str) -> list[tuple[int, tuple[int, ...]]]:
    """(in_features, output slice widths) of a zoo model's LoRA'd projections, fused as the
    engine fuses them: q|k|v, o, gate|up, down."""
    t = get_spec(model).text
    q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    return [(t.hidden_size, (q, kv, kv)), (q, (t.hidden_size,)),
            (t.hidden_size, (t.intermediate_size, t.intermediate_size)), (t.intermediate_size, (t.hidden_size,))]


def run(cfg: DictConfig):
    import torch

    from vlora_kernels.search import SearchJob, run_search

    if not torch.cuda.is_available():
        raise SystemExit("vlora tune profiles kernels on a CUDA GPU; none is available here")
    fields = OmegaConf.to_container(cfg.tune, resolve=True)
    models = fields.pop("models", [])
    job = to_dataclass(SearchJob, fields, layouts=[lay for m in models for lay in projection_layouts(m)])
    if job.log:
        Path(job.log).parent.mkdir(parents=True, exist_ok=True)
    return run_search(job)
