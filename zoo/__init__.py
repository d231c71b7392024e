"""The offline model zoo: Hugging Face-format checkpoints of Qwen2-VL, Qwen2.5-VL and LLaVA-1.5
with seeded random weights and a locally trained tokenizer, at tiny and published full sizes.

    build_checkpoint("qwen2_vl_tiny", "zoo/qwen2_vl_tiny")   # writes the directory
    model, processor = load_pretrained("zoo/qwen2_vl_tiny")  # Auto classes, no network
"""

from .build import (build_checkpoint, build_model, build_processor, build_tokenizer_and_ids, random_weights,
                    read_zoo_record)
from .configs import hf_config
from .load import load_pretrained
from .specs import ARCHITECTURES, SPECS, ImageSpec, ModelSpec, TextSpec, VisionSpec, get_spec

__all__ = [
    "ARCHITECTURES", "SPECS", "ImageSpec", "ModelSpec", "TextSpec", "VisionSpec", "get_spec", "hf_config",
    "build_checkpoint", "build_model", "build_processor", "build_tokenizer_and_ids", "random_weights",
    "read_zoo_record",
    "load_pretrained",
]
