"""The names of an adapter directory's files, and of the PEFT keys the language model's LoRA uses.

    <adapter>/
      adapter_config.json, adapter_model.safetensors   PEFT's own files (save_pretrained / from_pretrained)
      README.md                                        PEFT's model card (also its own output)
      meta.json                                        what V-LoRA knows of it (adapters.meta)
      heads/<domain>/head.safetensors + head.json      one task head per knowledge domain (heads.io)
      head.safetensors + head.json                     or a single head at the root
    <fusion out>/manifest.json                         which adapter and head serve each domain
"""

from __future__ import annotations

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_FILES = (PEFT_CONFIG, PEFT_WEIGHTS)
META = "meta.json"
HEADS_DIR = "heads"
ROOT_HEAD = "head"  # the file stem of a head: head.safetensors + head.json
MANIFEST = "manifest.json"


def peft_key(layer: int, block: str, module: str) -> str:
    """The PEFT key stem of one adapted language-model projection (what save_pretrained writes for
    these models), e.g. base_model.model.model.language_model.layers.3.self_attn.q_proj;
    block is "self_attn" or "mlp"."""
    return f"base_model.model.model.language_model.layers.{layer}.{block}.{module}"
