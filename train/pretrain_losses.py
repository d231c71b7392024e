"""Losses of the world pretraining: answers through the LM head, region captions through probes.

The probes read the region captions (`pretrain_data.dense_targets`) from two places: the vision
features the language model receives (a short path into the vision tower) and the language
model's final hidden states at the visual tokens (what task heads see later). They exist only
during pretraining; the saved checkpoint is the plain model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .model import visual_features
from .pretrain_data import DIRECTION_LABELS

PIXEL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


class RegionProbe(torch.nn.Module):
    """Pretraining-only readout of the region captions from a visual token's state: class, colour,
    object centre, motion, the object's box. Dropped when the checkpoint is saved."""

    def __init__(self, hidden: int, n_classes: int, n_colors: int):
        super().__init__()
        self.sizes = [n_classes + 1, n_colors + 1, 1, len(DIRECTION_LABELS), 4]
        self.proj = torch.nn.Linear(hidden, sum(self.sizes))

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden: [N, D] at visual tokens; targets: [N, 8] (see pretrain_data.dense_targets)."""
        cls, col, centre, direction, box = self.proj(hidden.float()).split(self.sizes, dim=-1)
        loss = F.cross_entropy(cls, targets[:, 0]) + F.cross_entropy(col, targets[:, 1])
        loss = loss + F.binary_cross_entropy_with_logits(centre[:, 0], targets[:, 2].float())
        if (targets[:, 3] >= 0).any():
            loss = loss + F.cross_entropy(direction, targets[:, 3], ignore_index=-100)
        held = targets[:, 4] >= 0  # cells with an object
        if held.any():
            loss = loss + 5.0 * F.l1_loss(box[held].sigmoid(), targets[held, 4:].float() / 1000)
        return loss


def feature_module(model) -> torch.nn.Module:
    """The module whose output is what the language model receives at the visual tokens."""
    core = model.model
    return core.multi_modal_projector if hasattr(core, "multi_modal_projector") else core.visual


def conversation_losses(model, probes: torch.nn.ModuleList, batch: dict, placeholder_ids: list[int]):
    """(answer loss, region loss) of a batch; the LM head runs only where answers are supervised.

    The region captions are read twice: from the vision features the language model receives
    (a short path to the vision tower) and from the final hidden states (what task heads see).
    A batch holds images only or clips only, so the captured features come in batch row order.
    """
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "dense")}
    captured = []
    hook = feature_module(model).register_forward_hook(lambda m, i, out: captured.append(out))
    try:
        hidden = model.model(**inputs, use_cache=False).last_hidden_state  # [B, T, D]
    finally:
        hook.remove()
    feats = []
    for c in captured:  # a tensor, or an output object whose pooler_output may be split per item
        out = getattr(c, "pooler_output", c)
        feats += list(out) if isinstance(out, (list, tuple)) else [out]
    feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats], dim=0)  # [N_visual, D]
    labels = batch["labels"][:, 1:]  # position t predicts token t + 1
    keep = labels != -100
    logits = model.lm_head(hidden[:, :-1][keep])  # [K, V]
    answer = F.cross_entropy(logits.float(), labels[keep])
    visual = torch.isin(batch["input_ids"], torch.tensor(placeholder_ids, device=hidden.device))
    region = probes[0].loss(hidden[visual], batch["dense"]) + probes[1].loss(feats, batch["dense"])
    return answer, region


def vision_loss(model, probes: torch.nn.ModuleList, batch: dict) -> torch.Tensor:
    """Region loss on the vision features alone: the vision tower and projector, no language model."""
    feats = visual_features(model, {k: batch[k] for k in PIXEL_KEYS if k in batch}, grad=True)  # [N, D]
    return probes[1].loss(feats, batch["dense"])

