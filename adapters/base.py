"""The base model an adapter was trained on: its identity, recorded with the adapter and checked
wherever adapters meet a model (the `vlora serve` command before it builds anything, the
engine's adapter manager on every load).

    identity = base_identity("/ckpt/qwen2_vl_7b", name="qwen2_vl_7b")
      -> {"name": ..., "path": "/abs/ckpt/qwen2_vl_7b", "fingerprint": "sha256:..."}
    same_base(recorded, identity) -> True | False | None (not enough known to tell)
    check_base(recorded, identity, what="adapter 'x'")   # BaseMismatch naming both bases

The fingerprint must be cheap on multi-GB checkpoints, so it never reads all the weights: it is a
SHA-256 over config.json, the safetensors index, and per weight file its name, its size, its
safetensors header (every tensor's name, dtype, shape and offsets) and samples of its bytes
(the whole file up to 64 MiB; above that 64 blocks of 64 KiB spread evenly over the data).
Headers and sizes alone would not do: a fine-tuned or pretrained checkpoint keeps the shapes of
the model it came from (the zoo's `qwen2_vl_tiny` and `qwen2_vl_tiny_pretrained` have identical
headers), so the samples are what tells such checkpoints apart. Copying or moving a checkpoint
keeps its fingerprint (no paths or times go in); two checkpoints that differ only in tensors no
sample touches would share one, a risk accepted for reading ~4 MiB instead of gigabytes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

FULL_HASH_BYTES = 64 << 20  # weight files up to this size are hashed whole
SAMPLE_COUNT = 64  # larger ones: this many blocks of the data...
SAMPLE_BYTES = 64 << 10  # ...of this many bytes each
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_META_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


class BaseMismatch(ValueError):
    """Adapters recorded for one base model, about to be used on another; the message names both."""


def fingerprint(checkpoint: str | os.PathLike) -> str | None:
    """The weights fingerprint of a checkpoint directory ("sha256:<hex>"), or None when there is none."""
    root = Path(checkpoint)
    if not root.is_dir():
        return None
    digest, seen = hashlib.sha256(), False
    for name in _META_FILES:
        file = root / name
        if file.is_file():
            digest.update(f"{name}\0".encode())
            digest.update(file.read_bytes())
            seen = True
    weights = sorted(f for f in root.iterdir() if f.suffix in WEIGHT_SUFFIXES and f.is_file())
    for file in weights:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as fh:
            if size <= FULL_HASH_BYTES:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
            else:
                _sample(fh, size, file.suffix == ".safetensors", digest)
    return f"sha256:{digest.hexdigest()}" if seen or weights else None


def _sample(fh, size: int, safetensors: bool, digest) -> None:
    start = 0
    if safetensors:  # 8 bytes of header length (little endian), then the JSON header
        header_len = int.from_bytes(fh.read(8), "little")
        digest.update(fh.read(header_len))
        start = 8 + header_len
    span = max(size - start - SAMPLE_BYTES, 0)
    for i in range(SAMPLE_COUNT):
        fh.seek(start + span * i // (SAMPLE_COUNT - 1))
        digest.update(fh.read(SAMPLE_BYTES))


def base_identity(checkpoint: str | os.PathLike, name: str | None = None, **extra) -> dict:
    """What identifies a base model: name (default: the folder's), absolute path, fingerprint (None
    while the directory does not exist), and any extra keys (e.g. arch)."""
    path = Path(checkpoint).expanduser()
    return {"name": name or path.name, "path": str(path.resolve()), "fingerprint": fingerprint(path), **extra}


def recorded_base(record: dict | None) -> dict | None:
    """The base identity an adapter's meta.json (its "base_model") or a manifest (its "base", or the
    "model" / "model_path" keys older fusion runs wrote) records; None when it records none."""
    if not isinstance(record, dict):
        return None
    for key in ("base_model", "base"):
        base = record.get(key)
        if isinstance(base, dict) and (base.get("fingerprint") or base.get("path")):
            return base
    if isinstance(record.get("model_path"), str):
        return {"name": record.get("model"), "path": record["model_path"], "fingerprint": None}
    return None


def same_base(a: dict | None, b: dict | None) -> bool | None:
    """Whether two identities name the same weights: by fingerprint when both have one, else by
    path; None when that cannot be told (one side unknown)."""
    if not a or not b:
        return None
    if a.get("fingerprint") and b.get("fingerprint"):
        return a["fingerprint"] == b["fingerprint"]
    if a.get("path") and b.get("path"):
        return Path(a["path"]).expanduser().resolve() == Path(b["path"]).expanduser().resolve()
    return None


def describe(base: dict | None) -> str:
    """One line naming a base: name (path, fingerprint prefix)."""
    if not base:
        return "an unknown base model"
    fp = base.get("fingerprint")
    where = ", ".join(x for x in (base.get("path"), f"fingerprint {fp[:19]}" if fp else "no fingerprint") if x)
    return f"{base.get('name') or 'unnamed'} ({where})"


def mismatch_message(recorded: dict, actual: dict, what: str) -> str:
    return (f"{what} was trained on base model {describe(recorded)}, but the model is {describe(actual)}; "
            "its answers would be meaningless on another base")


def check_base(recorded: dict | None, actual: dict | None, what: str) -> None:
    """Raises BaseMismatch when `recorded` and `actual` are known to differ."""
    if same_base(recorded, actual) is False:
        raise BaseMismatch(mismatch_message(recorded, actual, what))
