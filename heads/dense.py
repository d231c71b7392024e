"""Dense detection head: an objectness score and a box from every visual token.

A set head pools the whole prompt into a few vectors and must say from them where each object is;
on real footage that fails (F1 < 0.05 where a per-token probe on the same features reaches 0.4).
This head reads each visual token on its own, as one-stage detectors read a feature map: the token
whose cell holds a box's centre learns objectness 1 and that box, relative to its own cell (so a
token only says how far the centre is from it, and how big the box is). Tokens inside a box's
central region that are not its owner are ignored rather than pushed to 0, since they are not
wrong to see the object; the duplicates they give are removed at decode by non-maximum suppression.

Needs each token's cell centre, `token_xy` [B, T, 2] (`heads.grid`), beside the hidden states.
"""

from __future__ import annotations

import math
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .boxes import box_iou, cxcywh_to_xyxy, generalized_iou, xyxy_to_cxcywh
from .base import TaskHead
from .config import HeadConfig
from .detect import GIOU_WEIGHT, L1_WEIGHT, DetectHead

# A picture has a few owner tokens among hundreds: each owner's BCE counts this many times, and the
# objectness sum is normalised by the owners, so plain BCE is not won by predicting nothing. (Focal
# loss, tried first, left owners' scores at 0.2-0.4: under any fixed threshold.)
POS_WEIGHT = 4.0
NMS_IOU = 0.5  # a kept box suppresses lower-scored boxes overlapping it more than this
# A non-owner token is ignored when its centre lies in the middle of a box: this fraction of its
# width and height around the centre.
IGNORE_CORE = 0.5
_PRIOR = 0.01  # initial objectness: most tokens see no object
# Box outputs are linear in the offset (no squashing that saturates and stops learning) and scaled
# down: one optimiser step moves every output weight by about the learning rate, and summed over a
# token's features that would throw a centre across the picture. Sizes are learnt in log space
# around a tenth of the picture.
OFFSET_SCALE = 0.05
SIZE_SCALE, SIZE_PRIOR = 0.25, 0.1


class DenseDetectHead(DetectHead):
    """outputs: {"logits": [B, T] objectness (very negative off the visual tokens), "boxes": [B, T, 4]
    (cx, cy, w, h), "visual": [B, T] bool}; targets as `DetectHead`'s, any number of boxes a picture
    (max_boxes only caps the answer)."""

    bounded = False

    def __init__(self, config: HeadConfig):
        TaskHead.__init__(self, config)  # not DetectHead's: that one lays out box slots, this head has none
        d, width = config.hidden_size, config.dense_width
        self.hidden = nn.Linear(d, width) if width else None  # one hidden layer: the probe's MLP beat linear
        self.proj = nn.Linear(width or d, 5)
        with torch.no_grad():
            self.proj.bias.zero_()
            self.proj.weight[1:].zero_()  # every box starts on its own token's cell at the prior size
            self.proj.bias[0] = -math.log((1 - _PRIOR) / _PRIOR)

    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None,
                token_xy: Tensor | None = None) -> dict[str, Tensor]:
        mask = self._check_inputs(hidden, attention_mask)
        xy = self._check_xy(token_xy, hidden)
        visual = mask & (xy[..., 0] >= 0)
        empty = (~visual.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"token_xy: prompts {empty} have no visual token; a dense detect head reads boxes "
                             "off the picture's tokens")
        h = hidden.float()
        if self.hidden is not None:
            h = F.gelu(F.linear(h, self.hidden.weight.float(), self.hidden.bias.float()))
        h = F.dropout(h, self.config.dropout, self.training)
        out = F.linear(h, self.proj.weight.float(), self.proj.bias.float())  # [B, T, 5]
        cxcy = xy + OFFSET_SCALE * out[..., 1:3]  # offsets from the token's own cell
        wh = SIZE_PRIOR * torch.exp((SIZE_SCALE * out[..., 3:]).clamp(-8.0, 3.0))
        boxes = torch.cat([cxcy, wh], dim=-1)
        logits = torch.where(visual, out[..., 0], torch.full_like(out[..., 0], -1e4))
        return {"logits": logits, "boxes": boxes, "visual": visual, "xy": xy}

    def _check_xy(self, token_xy: Tensor | None, hidden: Tensor) -> Tensor:
        if token_xy is None:
            raise ValueError("a dense detect head needs token_xy [batch, tokens, 2], each visual token's cell "
                             "centre (heads.grid); none was given")
        if tuple(token_xy.shape) != (*hidden.shape[:2], 2):
            raise ValueError(f"token_xy: expected shape {(*hidden.shape[:2], 2)}, got {tuple(token_xy.shape)}")
        return token_xy.to(hidden.device, torch.float32)

    @torch.no_grad()
    def assign(self, outputs: dict[str, Tensor], targets: dict[str, Tensor]) -> tuple[list, list, list, Tensor]:
        """Per target box its owner token (the free visual token nearest its centre), and the
        tokens to leave out of the objectness loss: (batch idx, token idx) of the owners, their
        target idx, and an ignore mask [B, T]."""
        xy, visual = outputs["xy"].cpu(), outputs["visual"].cpu()  # one host copy per batch
        boxes, keep = targets["boxes"].float().cpu(), targets["box_mask"].cpu()
        b_idx, t_idx, m_idx = [], [], []
        ignore = torch.zeros_like(visual)
        for b in range(xy.shape[0]):
            taken: set[int] = set()
            for m in keep[b].nonzero().flatten().tolist():
                x1, y1, x2, y2 = boxes[b, m].tolist()
                cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
                dist = ((xy[b, :, 0] - cx) ** 2 + (xy[b, :, 1] - cy) ** 2).masked_fill(~visual[b], math.inf)
                for token in dist.argsort().tolist():  # the nearest, or the next one free
                    if token not in taken:
                        break
                taken.add(token)
                b_idx.append(b), t_idx.append(token), m_idx.append(m)
                hw, hh = IGNORE_CORE * (x2 - x1) / 2, IGNORE_CORE * (y2 - y1) / 2
                ignore[b] |= ((xy[b, :, 0] - cx).abs() <= hw) & ((xy[b, :, 1] - cy).abs() <= hh)
            ignore[b, list(taken)] = False
        return b_idx, t_idx, m_idx, ignore

    def loss(self, outputs: dict[str, Tensor], targets: dict[str, Tensor]) -> Tensor:
        logits, pred = outputs["logits"], outputs["boxes"]
        b_idx, t_idx, m_idx, ignore = self.assign(outputs, targets)
        objectness = torch.zeros_like(logits)
        objectness[b_idx, t_idx] = 1.0
        counted = outputs["visual"] & ~ignore.to(logits.device)
        ce = F.binary_cross_entropy_with_logits(logits, objectness, reduction="none")
        weight = 1.0 + (POS_WEIGHT - 1.0) * objectness
        n = max(1, len(b_idx))  # normalised by the owners, as one-stage detectors do
        loss = (weight * ce)[counted].sum() / n
        if b_idx:
            matched = pred[b_idx, t_idx]  # [N, 4] cxcywh
            wanted = targets["boxes"].to(pred.device, torch.float32)[b_idx, m_idx]  # [N, 4] xyxy
            l1 = (matched - xyxy_to_cxcywh(wanted)).abs().sum() / n
            giou = (1.0 - generalized_iou(cxcywh_to_xyxy(matched), wanted)).sum() / n
            loss = loss + L1_WEIGHT * l1 + GIOU_WEIGHT * giou
        return loss

    def kept(self, scores: Tensor, boxes: Tensor, threshold: float) -> list[int]:
        """The tokens decoded as boxes: over the threshold, after non-maximum suppression, best
        first, at most max_boxes (`DetectHead.decode` builds the answer from them)."""
        return _nms(scores, boxes, threshold, self.config.max_boxes)


def _nms(scores: Tensor, boxes: Tensor, threshold: float, most: int) -> list[int]:
    """Greedy non-maximum suppression over the tokens scoring above `threshold`: indices, best first."""
    # a box wholly off the picture is empty once clipped: not an answer
    real = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    candidates = ((scores > threshold) & real).nonzero().flatten()
    candidates = candidates[scores[candidates].argsort(descending=True)].tolist()
    if not candidates:
        return []
    overlap = box_iou(boxes[candidates], boxes[candidates])
    kept: list[int] = []
    for i, token in enumerate(candidates):
        if all(overlap[i, j] <= NMS_IOU for j in kept):
            kept.append(i)
            if len(kept) == most:
                break
    return [candidates[i] for i in kept]
