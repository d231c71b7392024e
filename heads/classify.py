"""Heads whose answer is one choice from a small set: a label, a count, or yes / no.

These are the cases the paper singles out (action classes, vehicle counts, binary queries): the
answer set is small and fixed, so one projection of the pooled feature replaces the several
decode rounds the LM head would need to spell the answer out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import TaskHead
from .config import HeadResult


class ClassifyHead(TaskHead):
    """Logits over `config.labels`, trained with cross-entropy.

    outputs: {"logits": [B, C]}; targets: {"labels": int64 [B]} (indices into config.labels).
    """

    def outputs_from(self, logits: Tensor) -> dict[str, Tensor]:
        return {"logits": logits}

    def loss(self, outputs: dict[str, Tensor], targets: dict[str, Tensor]) -> Tensor:
        logits = outputs["logits"]
        return F.cross_entropy(logits, targets["labels"].to(logits.device))

    def decode(self, outputs: dict[str, Tensor]) -> list[HeadResult]:
        probs = outputs["logits"].float().softmax(dim=-1)  # [B, C]
        conf, idx = probs.max(dim=-1)
        return [HeadResult(type=self.config.type, label=self.config.labels[i], confidence=c)
                for i, c in zip(idx.tolist(), conf.tolist())]

    def targets_from(self, examples: list[Any], device: torch.device | str | None = None) -> dict[str, Tensor]:
        """Each example: a label string from config.labels, or its index."""
        labels = self.config.labels
        index = {label: i for i, label in enumerate(labels)}
        out = []
        for n, ex in enumerate(examples):
            if isinstance(ex, str):
                if ex not in index:
                    shown = labels if len(labels) <= 20 else labels[:20] + ["..."]
                    raise ValueError(f"targets[{n}]={ex!r}: not a label of this head; labels are {shown}")
                out.append(index[ex])
            elif isinstance(ex, int) and not isinstance(ex, bool) and 0 <= ex < len(labels):
                out.append(ex)
            else:
                raise ValueError(f"targets[{n}]={ex!r}: expected a label string or an index in "
                                 f"0..{len(labels) - 1}")
        return {"labels": torch.tensor(out, dtype=torch.long, device=device)}


class CountHead(ClassifyHead):
    """A count as a bounded discrete range 0..max_count, trained with cross-entropy.

    Counting as classification (rather than regression) matches how counts are scored (exactly
    right or wrong) and gives a calibrated confidence. Targets above max_count are clamped to
    max_count: the last class reads "max_count or more", so a crowded frame in the training
    data is still a valid example rather than an error.
    """

    def decode(self, outputs: dict[str, Tensor]) -> list[HeadResult]:
        probs = outputs["logits"].float().softmax(dim=-1)  # [B, max_count + 1]
        conf, idx = probs.max(dim=-1)
        return [HeadResult(type="count", count=i, confidence=c) for i, c in zip(idx.tolist(), conf.tolist())]

    def targets_from(self, examples: list[Any], device: torch.device | str | None = None) -> dict[str, Tensor]:
        """Each example: a non-negative int (clamped to max_count)."""
        out = []
        for n, ex in enumerate(examples):
            if isinstance(ex, float) and ex.is_integer():
                ex = int(ex)
            if isinstance(ex, bool) or not isinstance(ex, int) or ex < 0:
                raise ValueError(f"targets[{n}]={ex!r}: a count must be a non-negative int")
            out.append(min(ex, self.config.max_count))
        return {"labels": torch.tensor(out, dtype=torch.long, device=device)}


_YES = {"yes": True, "no": False, "true": True, "false": False}


class BinaryHead(TaskHead):
    """One logit for "yes", trained with binary cross-entropy.

    outputs: {"logits": [B]}; targets: {"labels": float32 [B] of 0/1}.
    """

    def outputs_from(self, logits: Tensor) -> dict[str, Tensor]:
        return {"logits": logits[:, 0]}

    def loss(self, outputs: dict[str, Tensor], targets: dict[str, Tensor]) -> Tensor:
        logits = outputs["logits"]
        return F.binary_cross_entropy_with_logits(logits, targets["labels"].to(logits.device, logits.dtype))

    def decode(self, outputs: dict[str, Tensor]) -> list[HeadResult]:
        results = []
        for p in outputs["logits"].float().sigmoid().tolist():
            yes = p >= 0.5
            results.append(HeadResult(type="binary", answer="yes" if yes else "no",
                                      confidence=p if yes else 1.0 - p))
        return results

    def targets_from(self, examples: list[Any], device: torch.device | str | None = None) -> dict[str, Tensor]:
        """Each example: a bool, 0 / 1, or "yes" / "no" (any case)."""
        out = []
        for n, ex in enumerate(examples):
            if isinstance(ex, str) and ex.strip().lower() in _YES:
                out.append(_YES[ex.strip().lower()])
            elif isinstance(ex, bool) or (isinstance(ex, int) and ex in (0, 1)):
                out.append(bool(ex))
            else:
                raise ValueError(f"targets[{n}]={ex!r}: expected a bool, 0/1 or 'yes'/'no'")
        return {"labels": torch.tensor(out, dtype=torch.float32, device=device)}
