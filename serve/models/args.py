"""The language-model shape of a checkpoint, read from its Hugging Face config.

One frozen dataclass (gpt-fast's `ModelArgs`) holds everything the serving model needs; it is
read through `AutoConfig`, so partial configs of real checkpoints (LLaVA's `text_config` that
relies on Llama defaults, Qwen2-VL's flat pre-v5 layout with `rope_scaling`) come out complete.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ARCHS = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "llava": "llava"}


@dataclass(frozen=True)
class ModelArgs:
    arch: str  # "qwen2_vl" | "qwen2_5_vl" | "llava"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has q/k/v biases, Llama none
    max_position_embeddings: int
    image_token_id: int
    video_token_id: int | None = None
    mrope_section: tuple[int, int, int] | None = None  # Qwen: rotary pairs driven by (t, h, w)
    spatial_merge_size: int = 1
    tokens_per_second: float | None = None  # Qwen2.5-VL: temporal position units per second of video
    dtype: str = "float32"  # the checkpoint's dtype name

    @property
    def is_qwen(self) -> bool:
        return self.arch in ("qwen2_vl", "qwen2_5_vl")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope(text) -> tuple[float, list[int] | None]:
    params = getattr(text, "rope_parameters", None) or {}
    scaling = getattr(text, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(text, "rope_theta", None) or 10000.0)
    section = params.get("mrope_section") or scaling.get("mrope_section")
    return float(theta), section


def read_model_args(path: str | Path):
    """(ModelArgs, the full transformers config) of a checkpoint directory."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no config.json)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    arch = ARCHS.get(config.model_type)
    if arch is None:
        raise ValueError(f"{path}: model_type {config.model_type!r} is not served; "
                         f"supported: {sorted(ARCHS)}")
    text = getattr(config, "text_config", None) or config
    theta, section = _rope(text)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype = getattr(config, "dtype", None) or getattr(text, "dtype", None) or "float32"
    vision = config.vision_config
    args = ModelArgs(
        arch=arch,
        hidden_size=text.hidden_size,
        num_layers=text.num_hidden_layers,
        num_heads=text.num_attention_heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=text.intermediate_size,
        vocab_size=text.vocab_size,
        rms_norm_eps=text.rms_norm_eps,
        rope_theta=theta,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)
                                 or getattr(text, "tie_word_embeddings", False)),
        attention_bias=arch != "llava" or bool(getattr(text, "attention_bias", False)),
        max_position_embeddings=text.max_position_embeddings,
        image_token_id=getattr(config, "image_token_id", None) or config.image_token_index,
        video_token_id=getattr(config, "video_token_id", None),
        mrope_section=tuple(section) if arch != "llava" else None,
        spatial_merge_size=getattr(vision, "spatial_merge_size", 1) if arch != "llava" else 1,
        tokens_per_second=getattr(vision, "tokens_per_second", None) if arch == "qwen2_5_vl" else None,
        dtype=str(dtype).replace("torch.", ""),
    )
    if args.is_qwen and (args.mrope_section is None or 2 * sum(args.mrope_section) != head_dim):
        raise ValueError(f"{path}: mrope_section {args.mrope_section} must have 2 * sum = head_dim {head_dim}")
    return args, config
