"""Prompts of distilled rows: a domain's question in the chat format of the configured model."""
from __future__ import annotations

from pathlib import Path

from .distill_spec import DistillJob, DomainError


class PromptRenderer:
    """Question -> prompt in the model's chat format with its image / video placeholder."""

    def __init__(self, job: DistillJob):
        from transformers import AutoProcessor

        from zoo import SPECS, build_checkpoint

        path = Path(job.model_path) if job.model_path else None
        if path is None or not (path / "config.json").is_file():
            if job.model not in SPECS:
                raise DomainError(f"model {job.model!r} has no checkpoint at {path} and is not a zoo model "
                                  f"({sorted(SPECS)}); set model.path to a checkpoint directory")
            if path is None:
                raise DomainError(f"model {job.model!r}: no model_path given to build the zoo checkpoint into")
            build_checkpoint(job.model, path, seed=job.zoo_seed)
        self.processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        self.takes_video = getattr(self.processor, "video_processor", None) is not None
        self.model = job.model
        self.template = getattr(self.processor, "chat_template", None) or ""
        self._cache: dict[tuple[str, str], str] = {}

    def __call__(self, question: str, media: str) -> str:
        key = (question, media)
        if key not in self._cache:
            if media == "clip" and not self.takes_video:
                raise DomainError(f"model {self.model!r} takes no video; clip domains need a video model "
                                  f"(qwen2_vl_*, qwen2_5_vl_*)")
            content = [{"type": "video" if media == "clip" else "image"}, {"type": "text", "text": question}]
            self._cache[key] = self.processor.apply_chat_template([{"role": "user", "content": content}],
                                                                  add_generation_prompt=True)
        return self._cache[key]


__all__ = ["PromptRenderer"]
