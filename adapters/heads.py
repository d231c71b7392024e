"""The heads half of an adapter directory: where each knowledge domain's task head is stored.

    <adapter>/heads/<domain>/head.safetensors + head.json    one head per domain (a fused adapter)
    <adapter>/head.safetensors + head.json                   or one head at the root, named after
                                                             meta.json's only domain, else "default"

The two files of one head are heads.io's format (the config rebuilds the module: no pickled code).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from heads import TaskHead, save_head

from .layout import HEADS_DIR, ROOT_HEAD
from .peft import fail


def _has_head(directory: Path) -> bool:
    return (directory / f"{ROOT_HEAD}.json").is_file() or (directory / f"{ROOT_HEAD}.safetensors").is_file()


def find_heads(adapter_dir: str | Path, meta: dict) -> dict[str, Path]:
    """domain -> the directory holding its head files; {} when the adapter has none. A domain stored
    both at the root and under heads/ is an AdapterLoadError."""
    path = Path(adapter_dir)
    found: dict[str, Path] = {}
    domains = meta.get("domains") if isinstance(meta.get("domains"), dict) else {}
    if _has_head(path):
        found[next(iter(domains)) if len(domains) == 1 else "default"] = path
    heads_dir = path / HEADS_DIR
    if heads_dir.is_dir():
        for sub in sorted(heads_dir.iterdir()):
            if sub.is_dir() and _has_head(sub):
                if sub.name in found:
                    raise fail(path, f"head {sub.name!r} is stored twice (at the root and under {HEADS_DIR}/)")
                found[sub.name] = sub
    return found


def save_heads(adapter_dir: str | Path, heads: dict[str, TaskHead]) -> None:
    """Writes heads/<domain>/ for each head, replacing whatever heads/ held before (an earlier
    save of another state must not leave heads behind)."""
    heads_dir = Path(adapter_dir) / HEADS_DIR
    if heads_dir.exists():
        shutil.rmtree(heads_dir)
    for domain, head in heads.items():
        save_head(head, heads_dir / domain, name=ROOT_HEAD)
