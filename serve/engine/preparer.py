"""A request's prompt made ready for the engine without the engine: chat template, image and video
preprocessing, M-RoPE positions. It needs the checkpoint's processor and config only (no weights),
so a front end in another process than the engine prepares requests with its own copy
(`Preparer.from_checkpoint`) and hands the engine the result (`Engine.add_request(request, prepared)`).
"""

from __future__ import annotations

from pathlib import Path

from serve.models.args import ModelArgs
from serve.models.qwen2_vl import qwen_prompt_positions
from serve.models.vision import split_frame_groups


def prompt_positions(args: ModelArgs, token_ids: list[int], vision) -> tuple:
    """Positions of the prompt tokens ([3, P] with M-RoPE, None with 1-D RoPE as LLaVA's) and the
    delta after it, as the models' own `prompt_positions` answer."""
    return qwen_prompt_positions(args, token_ids, vision) if args.is_qwen else (None, 0)


class Preparer:
    def __init__(self, processor, args: ModelArgs):
        self.processor, self.args = processor, args  # processor: serve.models.PromptProcessor

    @classmethod
    def from_checkpoint(cls, path: str | Path, pixels: str = "host") -> "Preparer":
        """The checkpoint's processor and config, no weights (pixels: where the engine prepares
        Qwen pixel rows, as its PromptProcessor was built)."""
        from transformers import AutoProcessor

        from serve.models import PromptProcessor, read_model_args

        args, _ = read_model_args(path)
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        return cls(PromptProcessor(processor, args, pixels), args)

    def prepare(self, request) -> tuple:
        """(ProcessedPrompt, positions, delta) of a serve.engine.Request."""
        prompt = self.processor.process(request.prompt, request.messages, request.images, request.video,
                                        request.raw_prompt, request.prompt_token_ids)
        positions, delta = prompt_positions(self.args, prompt.token_ids, prompt.vision)
        prompt.vision = split_frame_groups(prompt.vision, self.args.spatial_merge_size ** 2)
        return prompt, positions, delta
