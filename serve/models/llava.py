"""LLaVA-1.5 for serving: Llama decoder with 1-D RoPE, CLIP tower and the two-layer projector."""

from __future__ import annotations

from .vision import LlavaVisionEncoder
from .vlm import VisionLanguageModel


class LlavaForServing(VisionLanguageModel):
    mrope = False

    def build_vision(self, hf_config, dtype, device):
        return LlavaVisionEncoder(hf_config, dtype, device)
