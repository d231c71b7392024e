"""The vision tower's projections as adapter-pool kinds, and where a PEFT key lands among them.

A served tower (serve.models: Qwen's `QwenVisionTower`, LLaVA's `ClipVisionTower`) keeps the
checkpoint's module names, so a PEFT module trained with `train_vision_tower` names its projection
after a marker (`visual.` / `vision_tower.`, then CLIP's `vision_model.`):

    base_model.model.model.visual.blocks.3.attn.qkv.lora_A.weight            -> kind tower.attn.qkv, layer 3
    base_model.model.model.visual.patch_embed.proj.lora_A.weight  [r, C, T, P, P]
                                                                   -> kind tower.patch_embed.proj, layer 0
    base_model.model.model.vision_tower.vision_model.encoder.layers.2.mlp.fc1...  -> kind tower.mlp.fc1, layer 2

Each projection of a block is a kind of one slice (the tower's q/k/v is one `qkv` linear, as PEFT
adapts it), one layer per block; Qwen's patch embedding, a convolution whose stride is its kernel,
is the linear map of a pixel row it is (A [r, C*T*P*P], B [out, r]), one layer. The merger and
LLaVA's projector are not served (no trainer adapts them). CLIP's layers past LLaVA's feature layer
never run, so their tensors are accepted and left out (their output is never read).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from .loader import ProjectionShape

PREFIX = "tower."  # tower kinds' names: apart from the language model's (both have a down_proj)
PATCH_EMBED = "patch_embed.proj"
_MARKERS = ("visual.", "vision_tower.")
_BLOCK = re.compile(r"^(?:blocks|encoder\.layers)\.(?P<layer>\d+)\.(?P<module>(?:attn|self_attn|mlp)\.\w+)$")
SKIP = ("", -1)  # `locate`: a module of a layer the tower never runs (layer -1)


@dataclass(frozen=True)
class TowerLayout:
    """The tower's projection kinds and their layer counts."""

    shapes: dict[str, ProjectionShape]
    layers: dict[str, int]  # kind -> layers that have it
    built: int  # blocks the tower runs
    depth: int  # blocks of the checkpoint's tower (CLIP runs only up to LLaVA's feature layer)

    def locate(self, module_path: str) -> tuple[str, int] | None:
        """(kind, layer) of a PEFT module path, SKIP for a block the tower never runs, None when
        it is not one of the tower's served projections."""
        for marker in _MARKERS:
            at = module_path.find(marker)
            if at >= 0 and (at == 0 or module_path[at - 1] == "."):
                rest = module_path[at + len(marker):]
                break
        else:
            return None
        rest = rest.removeprefix("vision_model.")
        if rest == PATCH_EMBED:
            kind, layer = PREFIX + PATCH_EMBED, 0
        else:
            m = _BLOCK.match(rest)
            if m is None:
                return None
            kind, layer = PREFIX + m["module"], int(m["layer"])
            if self.built <= layer < self.depth:
                return SKIP
        if kind not in self.shapes or layer >= self.layers[kind]:
            return None
        return kind, layer


def tower_of(model: nn.Module) -> nn.Module | None:
    """The tower module of a serving model (under a tensor-parallel `SplitVision`), or None."""
    encoder = getattr(model.vision, "inner", model.vision)
    return getattr(encoder, "visual", None) or getattr(encoder, "vision_tower", None)


def tower_projections(tower: nn.Module):
    """(kind, layer, module) of every served projection: each block's nn.Linear, then Qwen's patch
    embedding module (its forward takes pixel rows [rows, C*T*P*P])."""
    for name, module in tower.named_modules():
        m = _BLOCK.match(name)
        if m is not None and isinstance(module, nn.Linear):
            yield PREFIX + m["module"], int(m["layer"]), module
    patch = getattr(tower, "patch_embed", None)
    if patch is not None:
        yield PREFIX + PATCH_EMBED, 0, patch


def tower_layout(tower: nn.Module) -> TowerLayout:
    shapes, layers = {}, {}
    for kind, layer, module in tower_projections(tower):
        if isinstance(module, nn.Linear):
            fan_in, out = module.in_features, module.out_features
        else:  # the patch embedding's convolution, as a linear map of flattened pixel rows
            weight = module.proj.weight
            fan_in, out = weight[0].numel(), weight.shape[0]
        shapes.setdefault(kind, ProjectionShape(kind, fan_in, (out,), (kind,)))
        layers[kind] = max(layers.get(kind, 0), layer + 1)
    built = max(layers.values(), default=0)
    return TowerLayout(shapes, layers, built, getattr(tower, "depth", built))
