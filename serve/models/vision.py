"""Vision encoders: the transformers modules of each architecture with the checkpoint's weights.

An encoder takes the vision inputs of a whole step (any number of images and video clips of
any requests) and runs them through the tower in one batched call, returning one embedding
matrix [tokens of the item, LM hidden] per item, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .loader import WeightSource, load_submodule


@dataclass
class VisionInput:
    """One image or video clip of a prompt, preprocessed, and where its placeholders sit."""

    kind: str  # "image" | "video"
    pixel_values: torch.Tensor  # Qwen: [patches, C * T * P * P]; LLaVA: [1, 3, S, S]
    num_tokens: int  # placeholder tokens (= rows of its embedding)
    content_hash: str  # of the raw pixels: the key of the encoder cache and of prefix sharing
    grid_thw: tuple[int, int, int] | None = None  # Qwen patch grid
    second_per_grid_t: float = 1.0  # Qwen2.5-VL video
    offset: int = -1  # token index of its first placeholder in the prompt
    group_hashes: tuple[str, ...] | None = None  # Qwen video: one per temporal patch (frame group)


def split_frame_groups(items: list[VisionInput], merge2: int) -> list[VisionInput]:
    """Qwen video clips as one item per frame group (temporal patch), each keyed by its own frames.

    The Qwen towers attend within a frame group only (their attention segments and windows are
    per temporal slice, and rotary positions are spatial), so a group encodes alike alone or in its
    clip; as items of their own, groups already encoded (a static camera's repeated frames) come
    from the encoder cache and skip the tower. Call it after the prompt's positions are computed:
    those need the clip's whole grid."""
    out = []
    for item in items:
        if item.kind != "video" or item.group_hashes is None or item.grid_thw[0] < 2:
            out.append(item)
            continue
        t, h, w = item.grid_thw
        rows, tokens = h * w, h * w // merge2  # pixel rows and placeholder tokens of one group
        for i, key in enumerate(item.group_hashes):
            out.append(VisionInput("video", item.pixel_values[i * rows:(i + 1) * rows], tokens, key, (1, h, w),
                                   item.second_per_grid_t, item.offset + i * tokens))
    return out


def _init_on(device, fn):
    with torch.device(device):
        return fn()


class QwenVisionEncoder(nn.Module):
    """Qwen2-VL / Qwen2.5-VL vision transformer with its patch merger (outputs LM-width rows)."""

    def __init__(self, hf_config, arch: str, dtype: torch.dtype, device):
        super().__init__()
        if arch == "qwen2_vl":
            from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as cls
        else:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
                Qwen2_5_VisionTransformerPretrainedModel as cls,
            )
        self.visual = _init_on(device, lambda: cls._from_config(hf_config.vision_config, dtype=dtype)).eval()
        self.merge = hf_config.vision_config.spatial_merge_size

    def load(self, source: WeightSource) -> None:
        load_submodule(self.visual, source, ("model.visual.", "visual."), "vision tower")

    @torch.no_grad()
    def forward(self, items: list[VisionInput]) -> list[torch.Tensor]:
        device, dtype = self.visual.patch_embed.proj.weight.device, self.visual.patch_embed.proj.weight.dtype
        pixels = torch.cat([it.pixel_values for it in items]).to(device, dtype)
        grid = torch.tensor([it.grid_thw for it in items], dtype=torch.long, device=device)
        out = self.visual(pixels, grid_thw=grid)
        embeds = getattr(out, "pooler_output", out)  # transformers 5 returns an output object
        return list(embeds.split([it.num_tokens for it in items]))


class LlavaVisionEncoder(nn.Module):
    """CLIP vision tower, feature-layer selection and the multimodal projector of LLaVA-1.5."""

    def __init__(self, hf_config, dtype: torch.dtype, device):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        self.vision_tower = _init_on(device, lambda: AutoModel.from_config(hf_config.vision_config, dtype=dtype))
        self.multi_modal_projector = _init_on(device, lambda: LlavaMultiModalProjector(hf_config)).to(dtype)
        self.feature_layer = hf_config.vision_feature_layer
        self.strategy = hf_config.vision_feature_select_strategy
        self.eval()

    def load(self, source: WeightSource) -> None:
        load_submodule(self.vision_tower, source, ("model.vision_tower.", "vision_tower."), "vision tower")
        load_submodule(self.multi_modal_projector, source,
                       ("model.multi_modal_projector.", "multi_modal_projector."), "multimodal projector")

    @torch.no_grad()
    def forward(self, items: list[VisionInput]) -> list[torch.Tensor]:
        weight = self.multi_modal_projector.linear_1.weight
        pixels = torch.cat([it.pixel_values for it in items]).to(weight.device, weight.dtype)  # [N, 3, S, S]
        hidden = self.vision_tower(pixels, output_hidden_states=True).hidden_states
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else list(self.feature_layer)
        chosen = [hidden[i][:, 1:] if self.strategy == "default" else hidden[i] for i in layers]  # drop CLS
        feats = self.multi_modal_projector(torch.cat(chosen, dim=-1))  # [N, patches, D]
        return list(feats.unbind(0))
