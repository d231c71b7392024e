"""Saving a fusion result: every fused adapter through the trainer, then the manifest beside them."""

from __future__ import annotations

import os
from pathlib import Path

from adapters.manifest import write_manifest

from .spec import FusionResult, Trainer


def export_adapters(result: FusionResult, trainer: Trainer, out_dir: str | os.PathLike,
                    extra: dict | None = None) -> Path:
    """Save every fused adapter to out_dir/<name> with the trainer, then write the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for a in result.adapters:
        trainer.save(a.state, str(out / a.name))
        paths[a.index] = str(out / a.name)
    return write_manifest(result, out, paths, extra)
