"""Adapters that record their base model, for the tests of the base check and of adapter sources:
real PEFT directories (adapter_cases.make_adapter) with the meta.json training writes, and fusion
manifests written by fusion.export_adapters."""

from __future__ import annotations

import shutil
from pathlib import Path

from adapter_cases import make_adapter

from adapters import base_identity, write_meta
from fusion import Domain, FusedAdapter, FusionResult, export_adapters


def other_base(root: Path) -> Path:
    """A second qwen2_vl_tiny with other weights (seed 1): same shapes and headers as the zoo's,
    like a pretrained or fine-tuned copy of it."""
    from zoo import build_checkpoint

    return build_checkpoint("qwen2_vl_tiny", root / "qwen2_vl_tiny_seed1", seed=1)


def train_adapter(base: Path, out: Path, domains: dict[str, tuple[str, float]], seed: int = 5,
                  record_base: bool = True) -> Path:
    """What `vlora train` writes: PEFT files and meta.json with the domains (name -> (task,
    accuracy)) and, when record_base, the base model's identity."""
    make_adapter(base, out, ["q_proj", "v_proj"], 8, 16, seed=seed)
    meta = {"name": out.name, "tasks": sorted({t for t, _ in domains.values()}), "order": list(domains),
            "domains": {d: {"task": t, "head": None, "accuracy": a, "metric": "accuracy", "n_eval": 8}
                        for d, (t, a) in domains.items()},
            "created_by": "vlora train", "version": 1}
    if record_base:
        meta["base_model"] = base_identity(base, Path(base).name, arch="qwen2_vl")
    write_meta(out, meta)
    return out


class CopyTrainer:
    """fusion's Trainer.save for states that are adapter directories already."""

    def save(self, state, path: str) -> None:
        shutil.copytree(state, path)


def fusion_run(out_dir: Path, adapters: dict[int, tuple[Path, dict[str, float]]], base: Path) -> Path:
    """A fusion manifest in out_dir (adapters named <out_dir name>_<index>, as `vlora fusion`
    names them) over adapter directories: index -> (directory, domain -> accuracy)."""
    fused, order = [], []
    for i, (path, accs) in adapters.items():
        fused.append(FusedAdapter(i, f"fused_{i}", list(accs), dict(accs), {d: 0.5 for d in accs}, True, str(path)))
        order += [Domain(d, "binary", 0.5, 8) for d in accs]
    return export_adapters(FusionResult(fused, [], order), CopyTrainer(), out_dir,
                           extra={"base": base_identity(base, Path(base).name)})
