"""Our CLIP vision tower for LLaVA-1.5: the checkpoint's weights, only the layers the features need.

Same parameter names as transformers' CLIPVisionModel (`embeddings.*`, `pre_layrnorm`,
`encoder.layers.N.{self_attn.{q,k,v,out}_proj, layer_norm1, mlp.fc1, mlp.fc2, layer_norm2}`), so
the checkpoint loads as is. LLaVA reads the hidden states of one layer (the second to last by
default): transformers runs every layer and keeps all their outputs; this tower stops at the
deepest layer asked for and keeps only those. Every image of a step is one batch (they share the
processor's fixed size), one attention call per layer: the towers' segment attention, each image a
segment, so a GPU plans cuDNN's attention only for the image counts the warm-up ran and takes the
varlen kernel for others (serve/forward/segment_plans.py). Parity with transformers is tested (tiny zoo).
"""

from __future__ import annotations

import torch
from torch import nn

from ..forward.segments import Segments, plan_segments, segment_attention
from .qwen_vision import VisionMLP


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x, images: Segments):
        b, s, d = x.shape
        q, k, v = (p(x).view(b * s, self.heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(segment_attention(q, k, v, images).view(b, s, d))


class _Layer(nn.Module):
    def __init__(self, vc):
        super().__init__()
        d = vc.hidden_size
        self.self_attn = _Attention(d, vc.num_attention_heads)
        self.layer_norm1 = nn.LayerNorm(d, eps=vc.layer_norm_eps)
        self.mlp = VisionMLP(d, vc.intermediate_size, vc.hidden_act)
        self.layer_norm2 = nn.LayerNorm(d, eps=vc.layer_norm_eps)

    def forward(self, x, images: Segments):
        x = x + self.self_attn(self.layer_norm1(x), images)
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, vc):
        super().__init__()
        d, p = vc.hidden_size, vc.patch_size
        self.class_embedding = nn.Parameter(torch.zeros(d))
        self.patch_embedding = nn.Conv2d(vc.num_channels, d, kernel_size=p, stride=p, bias=False)
        self.position_embedding = nn.Embedding((vc.image_size // p) ** 2 + 1, d)
        self.image_size = vc.image_size

    def forward(self, pixels):
        if tuple(pixels.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"CLIP takes {self.image_size}x{self.image_size} images, got {tuple(pixels.shape[-2:])}")
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat((cls, patches), dim=1) + self.position_embedding.weight


class _Encoder(nn.Module):
    def __init__(self, vc, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(vc) for _ in range(layers))


class ClipVisionTower(nn.Module):
    """`feature_layers`: the hidden-state indices LLaVA reads (negative from the end, as in its config)."""

    def __init__(self, vc, feature_layers: list[int]):
        super().__init__()
        depth = vc.num_hidden_layers
        # hidden_states[0] is the embeddings after pre_layrnorm, [i] the output of layer i
        self.indices = [i if i >= 0 else depth + 1 + i for i in feature_layers]
        if any(not 0 <= i <= depth for i in self.indices):
            raise ValueError(f"vision_feature_layer {feature_layers} is outside a {depth}-layer tower")
        self.embeddings = _Embeddings(vc)
        self.pre_layrnorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)
        self.encoder = _Encoder(vc, max(self.indices))  # the layers past the deepest feature never run
        self.depth = depth  # the checkpoint's layers (an adapter of the tower may adapt the unrun ones)

    def forward(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """pixels [N, 3, S, S] -> the hidden states [N, 1 + patches, D] of each feature layer, in order."""
        x = self.pre_layrnorm(self.embeddings(pixels))
        images = plan_segments([x.shape[1]] * x.shape[0], x.device)
        kept = {0: x} if 0 in self.indices else {}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x, images)
            if i in self.indices:
                kept[i] = x
        return [kept[i] for i in self.indices]
