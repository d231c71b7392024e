"""meta.json: what an adapter directory holds beside PEFT's files (task, label sets, the knowledge
domains fused into it and the accuracy reached on each, the base model it was trained on).

Written by training (train.adapter_io builds the record); read by training, the server (which
reports it and picks heads by it) and the applications.
"""

from __future__ import annotations

import json
from pathlib import Path

from .files import write_json_atomic
from .layout import META

META_VERSION = 1


def meta_path(adapter_dir: str | Path) -> Path:
    return Path(adapter_dir) / META


def write_meta(adapter_dir: str | Path, meta: dict) -> dict:
    write_json_atomic(meta_path(adapter_dir), meta)
    return meta


def read_meta(adapter_dir: str | Path, required: bool = True) -> dict:
    """The directory's meta.json. Absent: FileNotFoundError, or {} when not required (a PEFT
    directory trained elsewhere has none). Not a JSON object: ValueError naming the file."""
    file = meta_path(adapter_dir)
    if not file.is_file():
        if required:
            raise FileNotFoundError(f"{adapter_dir} is not an adapter directory: no {META} (save_adapter writes it)")
        return {}
    try:
        meta = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(meta).__name__}")
    return meta
