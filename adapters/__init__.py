"""The adapter-on-disk contract, owned in one place and used by train, fusion, serve and apps.

    <adapter>/adapter_config.json, adapter_model.safetensors   PEFT's files       (peft.py)
    <adapter>/meta.json                                         V-LoRA's record    (meta.py)
    <adapter>/heads/<domain>/head.safetensors + head.json       task heads         (heads.py)
    <fusion out>/manifest.json                                  task -> adapter    (manifest.py)

The base model an adapter was trained on travels with it (meta.json's base_model, the
manifest's base: name, path, weights fingerprint) and is checked by base.py; sources.py reads
what a user hands over (manifests, single adapter directories, lists of both) as one set.

File names are in layout.py. This face imports no torch (applications read manifests);
`adapters.peft` and `adapters.heads` load torch when used.
"""

from .base import BaseMismatch, base_identity, check_base, describe, fingerprint, recorded_base, same_base
from .files import write_json_atomic
from .layout import HEADS_DIR, MANIFEST, META, PEFT_CONFIG, PEFT_FILES, PEFT_WEIGHTS, ROOT_HEAD, peft_key
from .manifest import CREATED_BY, ManifestError, Selection, read_manifest, select_adapter, write_manifest
from .meta import META_VERSION, read_meta, write_meta
from .sources import AdapterEntry, AdapterSet, read_sources

__all__ = [
    "HEADS_DIR", "MANIFEST", "META", "PEFT_CONFIG", "PEFT_FILES", "PEFT_WEIGHTS", "ROOT_HEAD", "peft_key",
    "CREATED_BY", "ManifestError", "Selection", "read_manifest", "select_adapter", "write_manifest",
    "META_VERSION", "read_meta", "write_meta", "write_json_atomic",
    "BaseMismatch", "base_identity", "check_base", "describe", "fingerprint", "recorded_base", "same_base",
    "AdapterEntry", "AdapterSet", "read_sources",
]
