"""Rotary position embeddings: 1-D (Llama) and multimodal M-RoPE (Qwen2-VL / Qwen2.5-VL).

M-RoPE gives every token three position ids (temporal, height, width). Text tokens carry the
same id three times; the tokens of an image or video span carry their patch-grid coordinates
offset by the position where the span starts. After a span, text resumes at
`start + max(h, w) / merge`, and every token past the prompt (the generated ones) sits at
`index + delta` with `delta = max(prompt positions) + 1 - prompt_len`. This follows
`get_rope_index` of transformers 5.x (Qwen2VLModel and Qwen2_5_VLModel) token for token,
including the Qwen2.5-VL temporal spacing `(t * tokens_per_second * second_per_grid_t).long()`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class VisionGrid:
    """One image or video span of a prompt as the processor laid it out."""

    kind: str  # "image" | "video"
    thw: tuple[int, int, int]  # patch grid before the spatial merge
    second_per_grid_t: float = 1.0  # video only (Qwen2.5-VL): seconds covered by one temporal patch


def _runs(types: list[int]):
    """(type, start, end) of each maximal run of equal token types, as transformers groups them."""
    for key, group in itertools.groupby(enumerate(types), lambda x: x[1]):
        group = list(group)
        yield key, group[0][0], group[-1][0] + 1


def mrope_prompt_positions(token_ids: list[int], grids: list[VisionGrid], image_token_id: int,
                           video_token_id: int | None, spatial_merge_size: int,
                           tokens_per_second: float | None = None) -> tuple[torch.Tensor, int]:
    """Position ids [3, L] (int64) of a prompt and its delta for the tokens that follow it.

    grids: the prompt's vision spans in order of appearance (images and videos interleaved as
    in the prompt; each modality is consumed in its own order, as transformers does).
    """
    types = [1 if t == image_token_id else 2 if (video_token_id is not None and t == video_token_id) else 0
             for t in token_ids]
    queues = {1: iter([g for g in grids if g.kind == "image"]), 2: iter([g for g in grids if g.kind == "video"])}
    merge = spatial_merge_size
    chunks, current = [], 0
    for key, start, end in _runs(types):
        if key == 0:
            chunks.append(torch.arange(end - start).view(1, -1).expand(3, -1) + current)
            current += end - start
            continue
        kind = "image" if key == 1 else "video"
        grid = next(queues[key], None)
        if grid is None:
            raise ValueError(f"prompt has more {kind} placeholder spans than {kind} grids ({len(grids)} grids)")
        t, h, w = grid.thw
        lt, lh, lw = t, h // merge, w // merge
        if end - start != lt * lh * lw:
            raise ValueError(f"{kind} span at tokens [{start}, {end}) holds {end - start} placeholders but its "
                             f"grid {grid.thw} with merge {merge} needs {lt * lh * lw}")
        interval = 1.0
        if key == 2 and tokens_per_second is not None:
            interval = torch.tensor(tokens_per_second, dtype=torch.float32) * torch.tensor(
                grid.second_per_grid_t, dtype=torch.float32)
        pos_t = (torch.arange(lt) * interval).long()
        grid_t, grid_h, grid_w = torch.meshgrid(pos_t, torch.arange(lh) + current, torch.arange(lw) + current,
                                                indexing="ij")
        span = torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1)
        span[0] += current
        chunks.append(span)
        current += max(h, w) // merge
    if not chunks:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(chunks, dim=1)
    return positions, int(positions.max()) + 1 - len(token_ids)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, H, D] and k [T, KVH, D] at positions [T] (1-D) or [3, T] (M-RoPE)."""

    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...] | None = None, device=None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.mrope_section = tuple(mrope_section) if mrope_section else None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, D] in `dtype`, computed in float32 as transformers does."""
        freqs = positions[..., None].float() * self.inv_freq  # [T, D/2] or [3, T, D/2]
        if self.mrope_section is not None:
            if positions.dim() != 2 or positions.shape[0] != 3:
                raise ValueError(f"M-RoPE needs positions [3, T], got {tuple(positions.shape)}")
            parts = freqs.split(list(self.mrope_section), dim=-1)
            freqs = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D] (broadcast over heads)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin
