"""Named model shapes of the zoo: the tiny test models and the published full sizes.

One table is the single source of truth for every shape; `configs.py` turns an entry into
the Hugging Face config of its architecture. The full-size entries copy the published
checkpoints' shapes (hidden size, layers, heads, KV heads, intermediate size, vocabulary and
vision tower) so GPU benchmarks run on real shapes with random weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ARCHITECTURES = ("qwen2_vl", "qwen2_5_vl", "llava")


@dataclass(frozen=True)
class TextSpec:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # rows of the embedding; the tokenizer may use fewer, as real checkpoints do
    tie_word_embeddings: bool = False
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    mrope_section: tuple[int, int, int] | None = None  # Qwen only: (t, h, w) rotary pairs

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class VisionSpec:
    hidden_size: int  # Qwen2-VL calls this embed_dim
    depth: int
    num_heads: int
    intermediate_size: int
    patch_size: int = 14
    # Qwen only
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112  # Qwen2.5-VL windowed attention
    fullatt_block_indexes: tuple[int, ...] = ()
    # CLIP (LLaVA) only
    image_size: int = 336
    projection_dim: int = 768


@dataclass(frozen=True)
class ImageSpec:
    """Preprocessing bounds; tiny models see small images so CPU runs stay fast."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str
    size: str  # "tiny", "small" (a GPU trains it from scratch in minutes) or "full"
    text: TextSpec
    vision: VisionSpec
    image: ImageSpec = field(default_factory=ImageSpec)
    tokenizer_vocab: int = 4096  # target size of the offline BPE vocabulary

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"ModelSpec {self.name!r}: arch {self.arch!r} is not one of {ARCHITECTURES}")
        if self.text.hidden_size % self.text.num_heads:
            raise ValueError(f"ModelSpec {self.name!r}: hidden_size must divide by num_heads")
        if self.text.mrope_section is not None and 2 * sum(self.text.mrope_section) != self.text.head_dim:
            raise ValueError(f"ModelSpec {self.name!r}: 2 * sum(mrope_section) must equal head_dim")


_QWEN_MROPE = (16, 24, 24)  # head_dim 128
_QWEN2_VL_VISION = VisionSpec(hidden_size=1280, depth=32, num_heads=16, intermediate_size=5120)
_QWEN2_5_VL_VISION = VisionSpec(
    hidden_size=1280, depth=32, num_heads=16, intermediate_size=3420, fullatt_block_indexes=(7, 15, 23, 31)
)
_CLIP_L_336 = VisionSpec(hidden_size=1024, depth=24, num_heads=16, intermediate_size=4096, image_size=336)
_TINY_QWEN_IMAGE = ImageSpec(min_pixels=56 * 56, max_pixels=224 * 224)  # at most 64 visual tokens
_TINY_TEXT = dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
                  vocab_size=2048, tie_word_embeddings=True, max_position_embeddings=4096)

SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        # --- tiny: a few million parameters at most, for tests and the CPU demo ---
        ModelSpec(
            "qwen2_vl_tiny", "qwen2_vl", "tiny",
            TextSpec(**_TINY_TEXT, mrope_section=(4, 6, 6)),
            VisionSpec(hidden_size=64, depth=2, num_heads=2, intermediate_size=256),
            image=_TINY_QWEN_IMAGE, tokenizer_vocab=2048,
        ),
        ModelSpec(
            "qwen2_5_vl_tiny", "qwen2_5_vl", "tiny",
            TextSpec(**_TINY_TEXT, mrope_section=(4, 6, 6)),
            VisionSpec(hidden_size=64, depth=2, num_heads=2, intermediate_size=128,
                       window_size=56, fullatt_block_indexes=(1,)),
            image=_TINY_QWEN_IMAGE, tokenizer_vocab=2048,
        ),
        ModelSpec(
            "llava_1_5_tiny", "llava", "tiny",
            TextSpec(**{**_TINY_TEXT, "num_kv_heads": 4, "tie_word_embeddings": False},
                     rope_theta=10000.0, rms_norm_eps=1e-5),
            VisionSpec(hidden_size=64, depth=2, num_heads=2, intermediate_size=256, image_size=112,
                       projection_dim=64),  # 112 / 14 = 8 x 8 = 64 visual tokens
            tokenizer_vocab=2048,
        ),
        # --- small: ~50 M parameters, the demo's GPU profile; world-pretrained on a GPU in minutes ---
        ModelSpec(
            "qwen2_vl_small", "qwen2_vl", "small",
            TextSpec(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=2048,
                     vocab_size=2048, tie_word_embeddings=True, max_position_embeddings=4096,
                     mrope_section=(8, 12, 12)),
            VisionSpec(hidden_size=384, depth=8, num_heads=6, intermediate_size=1536),
            # the world's 224 x 224 frames are scaled to 448 x 448: 256 visual tokens of 14 source
            # pixels each, so a bicycle a few pixels wide still fills a patch of its own
            image=ImageSpec(min_pixels=448 * 448, max_pixels=448 * 448), tokenizer_vocab=2048,
        ),
        # --- full sizes: published shapes, random weights, for GPU benchmarks ---
        ModelSpec(
            "qwen2_vl_2b", "qwen2_vl", "full",
            TextSpec(1536, 28, 12, 2, 8960, 151936, tie_word_embeddings=True, mrope_section=_QWEN_MROPE),
            _QWEN2_VL_VISION,
        ),
        ModelSpec(
            "qwen2_vl_7b", "qwen2_vl", "full",
            TextSpec(3584, 28, 28, 4, 18944, 152064, mrope_section=_QWEN_MROPE),
            _QWEN2_VL_VISION,
        ),
        # Qwen2-VL-72B-Instruct's config.json: hidden 8192, 80 layers, 64 heads, 8 KV heads, intermediate
        # 29568, vocab 152064, rope_theta 1e6, mrope_section [16, 24, 24], untied LM head, max positions
        # 32768; its vision_config is 7B's (embed_dim 1280, depth 32, 16 heads, mlp_ratio 4) with the
        # merger's output (hidden_size) 8192, which configs.py takes from the text side. ~73.4 B parameters:
        # at bf16 one GPU cannot hold it; tensor parallel builds and loads each rank's shard only
        ModelSpec(
            "qwen2_vl_72b", "qwen2_vl", "full",
            TextSpec(8192, 80, 64, 8, 29568, 152064, mrope_section=_QWEN_MROPE),
            _QWEN2_VL_VISION,
        ),
        ModelSpec(
            "qwen2_5_vl_3b", "qwen2_5_vl", "full",
            TextSpec(2048, 36, 16, 2, 11008, 151936, tie_word_embeddings=True, mrope_section=_QWEN_MROPE,
                     max_position_embeddings=128000),
            _QWEN2_5_VL_VISION,
        ),
        ModelSpec(
            "qwen2_5_vl_7b", "qwen2_5_vl", "full",
            TextSpec(3584, 28, 28, 4, 18944, 152064, mrope_section=_QWEN_MROPE, max_position_embeddings=128000),
            _QWEN2_5_VL_VISION,
        ),
        ModelSpec(
            "llava_1_5_7b", "llava", "full",
            TextSpec(4096, 32, 32, 32, 11008, 32064, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=4096),
            _CLIP_L_336,
        ),
        ModelSpec(
            "llava_1_5_13b", "llava", "full",
            TextSpec(5120, 40, 40, 40, 13824, 32064, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=4096),
            _CLIP_L_336,
        ),
    ]
}


def get_spec(name: str) -> ModelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown zoo model {name!r}; known: {sorted(SPECS)}") from None
