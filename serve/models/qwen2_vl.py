"""Qwen2-VL and Qwen2.5-VL for serving: Qwen2 decoder with M-RoPE, the Qwen vision transformer."""

from __future__ import annotations

import torch

from .rope import VisionGrid, mrope_prompt_positions
from .vision import QwenVisionEncoder, VisionInput
from .vlm import VisionLanguageModel


class Qwen2VLForServing(VisionLanguageModel):
    mrope = True

    def build_vision(self, hf_config, dtype, device):
        return QwenVisionEncoder(hf_config, self.args.arch, dtype, device)

    def prompt_positions(self, token_ids: list[int], vision: list[VisionInput]) -> tuple[torch.Tensor | None, int]:
        return qwen_prompt_positions(self.args, token_ids, vision)


def qwen_prompt_positions(args, token_ids: list[int], vision: list[VisionInput]) -> tuple[torch.Tensor | None, int]:
    """M-RoPE positions [3, P] of a prompt and the delta after it, from the model's config alone (a
    front end prepares requests with it, without the weights)."""
    if not vision:
        return None, 0
    grids = [VisionGrid(v.kind, v.grid_thw, v.second_per_grid_t) for v in vision]
    return mrope_prompt_positions(token_ids, grids, args.image_token_id, args.video_token_id, args.spatial_merge_size,
                                  args.tokens_per_second)
