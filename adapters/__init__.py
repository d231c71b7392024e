"""The adapter-on-disk contract, owned in one place and used by train, fusion, serve and apps.

    <adapter>/adapter_config.json, adapter_model.safetensors   PEFT's files       (peft.py)
    <adapter>/meta.json                                         V-LoRA's record    (meta.py)
    <adapter>/heads/<domain>/head.safetensors + head.json       task heads         (heads.py)
    <fusion out>/manifest.json                                  task -> adapter    (manifest.py)

File names are in layout.py. This face imports no torch (applications read manifests);
`adapters.peft` and `adapters.heads` load torch when used.
"""

from .files import write_json_atomic
from .layout import HEADS_DIR, MANIFEST, META, PEFT_CONFIG, PEFT_FILES, PEFT_WEIGHTS, ROOT_HEAD, peft_key
from .manifest import CREATED_BY, ManifestError, Selection, read_manifest, select_adapter, write_manifest
from .meta import META_VERSION, read_meta, write_meta

__all__ = [
    "HEADS_DIR", "MANIFEST", "META", "PEFT_CONFIG", "PEFT_FILES", "PEFT_WEIGHTS", "ROOT_HEAD", "peft_key",
    "CREATED_BY", "ManifestError", "Selection", "read_manifest", "select_adapter", "write_manifest",
    "META_VERSION", "read_meta", "write_meta", "write_json_atomic",
]
