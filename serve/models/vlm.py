"""The serving vision-language model: our decoder plus the architecture's vision encoder.

Subclasses (qwen2_vl.py, llava.py) say how to build the vision tower and where each prompt
token sits (M-RoPE or 1-D positions); everything else is shared.
"""

from __future__ import annotations

import torch
from torch import nn

from .args import ModelArgs
from .decoder import DecoderModel
from .loader import WeightSource, load_language_model
from .vision import VisionInput


class VisionLanguageModel(nn.Module):
    mrope = False  # positions are [3, T] (Qwen) rather than [T]

    def __init__(self, args: ModelArgs, hf_config, backend: str = "torch", dtype=torch.float32, device="cpu",
                 tp=None, tp_vision: str = "split"):
        """tp: a parallel.TPGroup: built as this rank's shard (parallel.py; the weights load into it after),
        the vision tower run as `tp_vision` says."""
        super().__init__()
        if tp is not None:
            from .parallel import check_shardable

            check_shardable(args, tp, tp_vision)  # before anything is built
        self.args = args
        self.language_model = DecoderModel(args, backend, dtype, device, tp)
        self.vision = self.build_vision(hf_config, dtype, device)
        if tp is not None:
            from .parallel import finish_shard

            finish_shard(self, tp, tp_vision)  # the local args, the tower shared out

    def build_vision(self, hf_config, dtype, device) -> nn.Module:
        raise NotImplementedError

    def prompt_positions(self, token_ids: list[int], vision: list[VisionInput]) -> tuple[torch.Tensor | None, int]:
        """Positions of the prompt tokens ([3, P] for M-RoPE, None for 1-D) and the delta after it."""
        return None, 0

    def load(self, source: WeightSource) -> None:
        load_language_model(self.language_model, source)
        self.vision.load(source)

    def encode(self, items: list[VisionInput]) -> list[torch.Tensor]:
        """Embeddings [num_tokens, hidden] of each vision input, one batched tower call."""
        return self.vision(items) if items else []

    def positions(self, prompt_positions: torch.Tensor | None, delta: int, prompt_len: int,
                  start: int, end: int) -> torch.Tensor:
        """Positions of tokens [start, end) of a sequence: [end - start] or [3, end - start] (host)."""
        if not self.mrope:
            return torch.arange(start, end)
        parts = []
        if start < prompt_len and prompt_positions is not None:
            parts.append(prompt_positions[:, start:min(end, prompt_len)])
        elif start < prompt_len:  # text-only prompt: plain positions
            parts.append(torch.arange(start, min(end, prompt_len)).expand(3, -1))
        if end > prompt_len:  # generated tokens continue after the prompt's last position
            parts.append((torch.arange(max(start, prompt_len), end) + delta).expand(3, -1))
        return torch.cat(parts, dim=1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mm_embeds: torch.Tensor | None = None,
                mm_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: [T]; positions: [T] or [3, T] -> hidden states [T, D]."""
        x = self.language_model.embed(input_ids, mm_embeds, mm_mask)
        return self.language_model(x, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
