"""Vision encoders: each architecture's tower with the checkpoint's weights.

Qwen2-VL / Qwen2.5-VL run our own tower (`qwen_vision.py`: one packed pass, one attention launch
per layer); LLaVA-1.5 our CLIP tower (`clip_vision.py`: fixed-size images in one batch, only the
layers up to the feature layer).

An encoder takes the vision inputs of a whole step (any number of images and video clips of
any requests) and runs them through the tower in one batched call, returning one embedding
matrix [tokens of the item, LM hidden] per item, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from heads import FULL, grid_xy, square_cells

from .deferred import Deferred, materialize
from .loader import WeightSource, load_submodule
from .clip_vision import ClipVisionTower
from .qwen_vision import QwenVisionTower


@dataclass
class VisionInput:
    """One image or video clip of a prompt, preprocessed, and where its placeholders sit."""

    kind: str  # "image" | "video"
    pixel_values: torch.Tensor | None  # Qwen: [patches, C * T * P * P]; LLaVA: [1, 3, S, S]; None: deferred
    num_tokens: int  # placeholder tokens (= rows of its embedding)
    content_hash: str  # of the raw pixels: the key of the encoder cache and of prefix sharing
    grid_thw: tuple[int, int, int] | None = None  # Qwen patch grid
    second_per_grid_t: float = 1.0  # Qwen2.5-VL video
    offset: int = -1  # token index of its first placeholder in the prompt
    group_hashes: tuple[str, ...] | None = None  # Qwen video: one per temporal patch (frame group)
    deferred: Deferred | None = None  # Qwen: raw frames, made pixel rows on the tower's device at encode time
    window: tuple[float, float, float, float] = FULL  # the part of the picture its tokens cover (LLaVA: the crop)


def token_cells(item: VisionInput, merge: int) -> torch.Tensor:
    """[num_tokens, 2] each of the item's tokens' cell centre in its picture (heads.grid), in the
    towers' token order: Qwen's merged grid per frame group, CLIP's square grid over the crop."""
    if item.grid_thw is None:
        return square_cells(item.num_tokens, item.window)
    t, h, w = item.grid_thw
    return grid_xy(h // merge, w // merge, frames=t)


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
        per = item.deferred.spec.temporal if item.deferred is not None else None
        for i, key in enumerate(item.group_hashes):
            pixels = None if per else item.pixel_values[i * rows:(i + 1) * rows]
            deferred = item.deferred.slice(i * per, (i + 1) * per) if per else None
            out.append(VisionInput("video", pixels, tokens, key, (1, h, w), item.second_per_grid_t,
                                   item.offset + i * tokens, deferred=deferred))
    return out


def _init_on(device, fn):
    with torch.device(device):
        return fn()


class QwenVisionEncoder(nn.Module):
    """Qwen2-VL / Qwen2.5-VL vision transformer with its patch merger (outputs LM-width rows)."""

    def __init__(self, hf_config, arch: str, dtype: torch.dtype, device):
        super().__init__()
        self.visual = _init_on(device, lambda: QwenVisionTower(hf_config.vision_config, arch)).to(dtype).eval()
        self.merge = hf_config.vision_config.spatial_merge_size

    def load(self, source: WeightSource) -> None:
        load_submodule(self.visual, source, ("model.visual.", "visual."), "vision tower")

    @torch.no_grad()
    def forward(self, items: list[VisionInput]) -> list[torch.Tensor]:
        device, dtype = self.visual.patch_embed.proj.weight.device, self.visual.patch_embed.proj.weight.dtype
        layout = self.visual.layout([it.grid_thw for it in items])
        late = [it for it in items if it.pixel_values is None]
        made = iter(materialize([it.deferred for it in late], device, dtype) if late else [])
        pixels = torch.cat([next(made) if it.pixel_values is None else it.pixel_values.to(device, dtype, non_blocking=True)
                            for it in items])
        return list(self.visual(pixels, layout).split([it.num_tokens for it in items]))


class LlavaVisionEncoder(nn.Module):
    """CLIP vision tower (ours), feature-layer selection and the multimodal projector of LLaVA-1.5."""

    def __init__(self, hf_config, dtype: torch.dtype, device):
        super().__init__()
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        feature = hf_config.vision_feature_layer
        self.layers = [feature] if isinstance(feature, int) else list(feature)
        self.vision_tower = _init_on(device, lambda: ClipVisionTower(hf_config.vision_config, self.layers)).to(dtype)
        self.multi_modal_projector = _init_on(device, lambda: LlavaMultiModalProjector(hf_config)).to(dtype)
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
        hidden = self.vision_tower(pixels)  # one tensor per feature layer
        chosen = [h[:, 1:] if self.strategy == "default" else h for h in hidden]  # "default" drops CLS
        feats = self.multi_modal_projector(torch.cat(chosen, dim=-1))  # [N, patches, D]
        return list(feats.unbind(0))
