"""Loading a checkpoint directory (zoo-built or a real one) through the Auto classes, offline."""

from __future__ import annotations

from pathlib import Path

from .build import DTYPES

_DTYPES = {**DTYPES, "auto": "auto"}


def load_pretrained(path: str | Path, dtype: str = "auto", device: str = "cpu"):
    """Returns (model, processor) from a Hugging Face-format directory, never touching the network."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no config.json); "
                                "build zoo models with `vlora zoo` or pass the path of a real checkpoint")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=_DTYPES[dtype], local_files_only=True)
    return model.to(device).eval(), processor
