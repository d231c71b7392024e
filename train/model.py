"""The vision-language model under training: a Hugging Face checkpoint with a PEFT LoRA on its
language model, split into the two halves the trainer drives separately.

    visual features (vision tower + projector)  ->  frozen by default, computed once per item
    language model (+ LoRA) on the embedded prompt ->  final hidden states [B, T, D] (heads)
                                                    ->  LM logits [B, T, V] (`lm` tasks)

Splitting at the embedding layer is what lets the trainer cache the vision tower's output per
item: the token embeddings are computed, the cached visual features are scattered into the
placeholder positions (exactly what the model's own forward does), and only the language model
runs every step. Works for Qwen2-VL, Qwen2.5-VL (M-RoPE positions are computed once per item
by the model's own `get_rope_index`) and LLaVA-1.5 (images only).
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .vision_attention import batch_vision_attention

ARCHS = ("qwen2_vl", "qwen2_5_vl", "llava")
# Linear layers of each vision tower, for LoRA on the tower when `train_vision_tower` is set.
VISION_LINEARS = {
    "qwen2_vl": ("qkv", "proj", "fc1", "fc2"),
    "qwen2_5_vl": ("qkv", "proj", "gate_proj", "up_proj", "down_proj"),
    "llava": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
}


@dataclass
class ModelRef:
    """Which checkpoint to load (conf/model/*.yaml): a zoo name or any HF-format directory."""

    name: str
    path: str
    arch: str | None = None  # read from the checkpoint's config when None
    dtype: str = "float32"  # storage dtype of the base weights: float32 | bfloat16 | float16


@dataclass
class LoraSpec:
    """The LoRA placed on the language model (conf/adapter/*.yaml)."""

    rank: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    name: str = "lora"

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraSpec.rank={self.rank!r}: must be an int >= 1")
        if not self.alpha > 0:
            raise ValueError(f"LoraSpec.alpha={self.alpha!r}: must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSpec.dropout={self.dropout!r}: must be in [0, 1)")
        if isinstance(self.target_modules, str) or not self.target_modules:
            raise ValueError(f"LoraSpec.target_modules={self.target_modules!r}: a non-empty list of module "
                             "names of the language model, e.g. [q_proj, k_proj, v_proj, o_proj]")
        self.target_modules = [str(m) for m in self.target_modules]


def arch_of(model: nn.Module) -> str:
    arch = getattr(model.config, "model_type", None)
    if arch not in ARCHS:
        raise ValueError(f"model type {arch!r} is not supported for training; supported: {list(ARCHS)}")
    return arch


def target_regex(arch: str, lora: LoraSpec, train_vision_tower: bool) -> str:
    """A PEFT `target_modules` regex: the named projections of the language model only.

    A name list alone would also hit LLaVA's CLIP tower (it has q_proj/k_proj/v_proj too), so the
    pattern anchors on `language_model`. With `train_vision_tower`, the tower's linears get LoRA too.
    """
    lm = rf".*\.language_model\..*\.({'|'.join(map(re.escape, lora.target_modules))})"
    if not train_vision_tower:
        return lm
    tower = rf".*\.(visual|vision_tower)\..*\.({'|'.join(VISION_LINEARS[arch])})"
    return f"({lm})|({tower})"


def load_base(ref: ModelRef, device: str | torch.device = "cpu"):
    """(model, processor) of the checkpoint, frozen, offline; the arch is checked against `ref`."""
    from zoo import load_pretrained

    model, processor = load_pretrained(ref.path, dtype=ref.dtype, device=str(device))
    arch = arch_of(model)
    if ref.arch is not None and ref.arch != arch:
        raise ValueError(f"model {ref.name!r}: config says arch {ref.arch!r} but {ref.path} holds a {arch!r} model")
    model.requires_grad_(False)
    batch_vision_attention(model)  # one attention call per layer for a batch's pictures, not one per picture
    return model, processor


def wrap_lora(model: nn.Module, lora: LoraSpec, train_vision_tower: bool = False, seed: int = 0):
    """The PEFT model with a fresh LoRA (adapter name "default"); B = 0, so outputs are unchanged."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=target_regex(arch_of(model), lora, train_vision_tower), bias="none")
    torch.manual_seed(seed)  # LoRA A is drawn at random: seeded, so a run is reproducible
    with warnings.catch_warnings():  # PEFT asks transformers a deprecated gradient-checkpointing question
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        return get_peft_model(model, config)


def core_of(model: nn.Module) -> nn.Module:
    """The `*Model` inside `*ForConditionalGeneration` (under PEFT's wrappers if any)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.model


def lm_head_of(model: nn.Module) -> nn.Module:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.lm_head


def visual_features(model: nn.Module, pixels: dict[str, Tensor], grad: bool = False) -> Tensor:
    """Vision tower + projector output for ONE item: [n_visual_tokens, D] in the LM's width."""
    with torch.set_grad_enabled(grad):
        core = core_of(model)
        if arch_of(model) == "llava":
            cfg = core.config
            out = core.get_image_features(pixel_values=pixels["pixel_values"],
                                          vision_feature_layer=cfg.vision_feature_layer,
                                          vision_feature_select_strategy=cfg.vision_feature_select_strategy)
        elif "pixel_values_videos" in pixels:
            out = core.get_video_features(pixels["pixel_values_videos"], pixels["video_grid_thw"])
        else:
            out = core.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
        # transformers 5.x returns an output object (pooler_output = per-item features); keep
        # the plain tensor / tuple forms too.
        out = getattr(out, "pooler_output", out)
        if isinstance(out, (list, tuple)):
            out = torch.cat([o.reshape(-1, o.shape[-1]) for o in out], dim=0)
        return out.reshape(-1, out.shape[-1])


def rope_positions(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor | None:
    """M-RoPE positions [3, L] of ONE unpadded Qwen item (None for LLaVA: plain 0..L-1).

    Called through the model's own `get_rope_index`, passing only the arguments its signature
    names (they differ between transformers releases).
    """
    if arch_of(model) == "llava":
        return None
    core = core_of(model)
    wanted = inspect.signature(core.get_rope_index).parameters
    keys = ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts",
            "attention_mask")
    kwargs = {k: inputs[k] for k in keys if k in wanted and k in inputs}
    positions, _ = core.get_rope_index(**kwargs)
    return positions[:, 0]  # [3, L]


def language_forward(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                     visual: Tensor | None, visual_mask: Tensor) -> Tensor:
    """Final hidden states [B, T, D] of the language model (LoRA applied, final norm included).

    input_ids, attention_mask: [B, T]; position_ids: [3, B, T] (Qwen) or [B, T] (LLaVA);
    visual: [N, D] features of every placeholder token of the batch in row-major order;
    visual_mask: [B, T] bool, True at the N placeholder positions.
    """
    core = core_of(model)
    embeds = core.get_input_embeddings()(input_ids)  # [B, T, D]
    if visual is not None and visual.numel():
        embeds = embeds.masked_scatter(visual_mask[..., None], visual.to(embeds.dtype))
    out = core.language_model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False)
    return out.last_hidden_state


def frozen_linears_to(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the frozen linear weights of the language model's decoder layers in `dtype`, the
    autocast dtype of mixed-precision training; returns how many layers were cast.

    Autocast casts a weight on every call and caches the cast only for weights that require
    grad, so each frozen projection of a float32 checkpoint was copied to bf16 in every forward
    (about a third of a small model's kernel launches per step). Casting them once gives the
    same bf16 values, so the matmuls are unchanged; embeddings, norms, the residual stream and
    LoRA stay float32. Only for code that runs the layers under autocast (all of `train/` does).
    """
    layers = core_of(model).language_model.layers
    n = 0
    for module in layers.modules():
        if isinstance(module, nn.Linear) and not any(p.requires_grad for p in module.parameters()):
            module.to(dtype)
            n += 1
    return n


def enable_checkpointing(model: nn.Module) -> None:
    """Gradient checkpointing of the decoder layers, non-reentrant: LoRA's parameters get their
    gradients without the inputs needing requires_grad (the reentrant form would need that)."""
    kw = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # its name in later transformers releases
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def maybe_compile(module: nn.Module, enabled: bool) -> nn.Module:
    """`torch.compile` of a training module when `enabled`: the eager step of a LoRA model issues
    thousands of small kernels (casts, scalings, norms, rotary) and at batch 8 the host, not the
    GPU, sets its pace. Shapes that change (other prompt lengths) recompile, then go dynamic."""
    return torch.compile(module) if enabled else module


class AdapterModule(nn.Module):
    """The trainable whole: the PEFT model and the task head of the domain being trained.

    One module so `accelerate` can place and wrap it (DDP on several GPUs sees one forward).
    forward(batch) -> {"hidden": [B, T, D], "mask": [B, T], "token_xy": [B, T, 2] or None, "logits": [B, T, V] if lm}.
    """

    def __init__(self, peft_model: nn.Module, head: nn.Module | None):
        super().__init__()
        self.lm = peft_model
        self.head = head

    def forward(self, batch: dict[str, Tensor], want_logits: bool = False) -> dict[str, Tensor]:
        visual = batch.get("visual")
        if visual is None and "pixels" in batch:  # vision tower under training: run it here
            visual = torch.cat([visual_features(self.lm, p, grad=True) for p in batch["pixels"]], dim=0)
        hidden = language_forward(self.lm, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                  visual, batch["visual_mask"])
        out = {"hidden": hidden, "mask": batch["attention_mask"], "token_xy": batch.get("token_xy")}
        if want_logits:
            out["logits"] = lm_head_of(self.lm)(hidden)  # [B, T, V]
        return out
