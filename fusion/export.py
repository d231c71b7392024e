"""Saving a fusion result: every fused adapter through the trainer, then the manifest beside them.

Adapters are named `<run>_<index>` (run: by default the name of the output folder, so the default
`adapters/fused` gives fused_0, fused_1, ... and `adapters/plates` gives plates_0, ...): two fusion
runs into different folders can be served together without their names clashing.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

from adapters.manifest import write_manifest

from .spec import FusionResult, Trainer

_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def run_adapter_name(run: str, index: int) -> str:
    return f"{run}_{index}"


def export_adapters(result: FusionResult, trainer: Trainer, out_dir: str | os.PathLike,
                    extra: dict | None = None, run: str | None = None,
                    questions: dict[str, str | None] | None = None, media: dict[str, str] | None = None) -> Path:
    """Save every fused adapter to out_dir/<run>_<index> with the trainer, then write the manifest
    (which records `run`, and each domain's question and media from `questions` and `media`). run defaults to out_dir's
    folder name."""
    out = Path(out_dir)
    run = run or out.resolve().name
    if not _RUN_NAME.match(run):
        raise ValueError(f"fusion run name {run!r}: use letters, digits, '_', '-' or '.' (it prefixes adapter names)")
    out.mkdir(parents=True, exist_ok=True)
    named = FusionResult([replace(a, name=run_adapter_name(run, a.index)) for a in result.adapters], result.events,
                         result.order)
    paths = {}
    for a in named.adapters:
        trainer.save(a.state, str(out / a.name))
        paths[a.index] = str(out / a.name)
    return write_manifest(named, out, paths, {"run": run, **(extra or {})}, questions, media)
