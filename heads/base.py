"""`TaskHead`: pooling of the final hidden states and a projection, in fp32 whatever comes in.

A head sees the language model's final hidden states after one prefill, pools them into one
feature per input and projects it to its outputs. The same module runs in training (with
`loss`) and in the server (`predict` = forward + `decode`), so every step here is
batch-shape agnostic and independent of how the batch was padded.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import HeadConfig, HeadResult


class TaskHead(nn.Module):
    """Base of every head: owns the pooling query (if any) and the output projection.

    Parameters may be stored in bf16/fp16 to save memory in the server; the computation is
    always fp32 (inputs and weights are upcast) because logits for sigmoid/softmax losses and
    box regression lose too much precision in half types to train stably.
    """

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        if config.pooling == "attention":
            # Zero init: the first softmax is uniform, so training starts from mean pooling
            # (a sensible feature) instead of a random token weighting.
            self.query = nn.Parameter(torch.zeros(d))
        elif config.pooling == "slots":
            # Random, not zero, so slots start out reading different tokens; small, so each softmax
            # starts near uniform (mean pooling).
            generator = torch.Generator().manual_seed(0)
            self.queries = nn.Parameter(0.02 * torch.randn(config.max_boxes, d, generator=generator))
        self.proj = nn.Linear(d, config.num_outputs)

    # -- the parts each head supplies -------------------------------------------------------
    def outputs_from(self, logits: Tensor) -> dict[str, Tensor]:
        """Raw projection [B, num_outputs] -> the head's named outputs."""
        raise NotImplementedError

    def loss(self, outputs: dict[str, Tensor], targets: dict[str, Tensor]) -> Tensor:
        raise NotImplementedError

    def decode(self, outputs: dict[str, Tensor]) -> list[HeadResult]:
        raise NotImplementedError

    def targets_from(self, examples: list[Any], device: torch.device | str | None = None) -> dict[str, Tensor]:
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------------
    def forward(self, hidden: Tensor, attention_mask: Tensor | None = None,
                token_xy: Tensor | None = None) -> dict[str, Tensor]:
        """hidden: [B, T, D] (any float dtype); attention_mask: [B, T], nonzero = real token;
        token_xy: [B, T, 2] each visual token's cell centre (`heads.grid`), read by dense heads only."""
        pooled = self.pool(hidden, attention_mask)  # [B, D] fp32 ([B, S, D] for slots)
        pooled = F.dropout(pooled, self.config.dropout, self.training)
        if self.config.pooling == "slots":  # slot s projects its own pooled vector with its own rows
            s = pooled.shape[1]
            weight = self.proj.weight.float().view(s, -1, pooled.shape[-1])  # [S, outputs per slot, D]
            logits = torch.einsum("bsd,sod->bso", pooled, weight) + self.proj.bias.float().view(s, -1)
            return self.outputs_from(logits.reshape(logits.shape[0], -1))  # [B, S * outputs per slot]
        logits = F.linear(pooled, self.proj.weight.float(), self.proj.bias.float())  # [B, num_outputs]
        return self.outputs_from(logits)

    @torch.no_grad()
    def predict(self, hidden: Tensor, attention_mask: Tensor | None = None,
                token_xy: Tensor | None = None) -> list[HeadResult]:
        """One structured answer per input: what the server returns in `head` mode."""
        return self.decode(self(hidden, attention_mask, token_xy))

    def pool(self, hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """[B, T, D] -> [B, D] in fp32, looking only at real tokens.

        Padded positions are excluded with `where` rather than multiplied by zero, so whatever
        a padded position holds (even inf/nan from a half-precision overflow) cannot leak in.
        Left and right padding give the same result.
        """
        mask = self._check_inputs(hidden, attention_mask)  # [B, T] bool
        h = hidden.float()  # h: [B, T, D]
        pooling = self.config.pooling
        if pooling == "last":
            t = hidden.shape[1]
            positions = torch.arange(t, device=h.device).expand_as(mask)  # [B, T]
            # Largest real position, which is the last real token under either padding side.
            last = torch.where(mask, positions, -1).amax(dim=1)  # [B]
            return h[torch.arange(h.shape[0], device=h.device), last]
        h = torch.where(mask[..., None], h, 0.0)
        if pooling == "mean":
            return h.sum(dim=1) / mask.sum(dim=1, keepdim=True).float()
        if pooling == "slots":
            scores = (h @ self.queries.float().T) / math.sqrt(h.shape[-1])  # [B, T, S]
            weights = torch.softmax(scores.masked_fill(~mask[..., None], float("-inf")), dim=1)
            return torch.einsum("bts,btd->bsd", weights, h)  # [B, S, D]
        scores = (h @ self.query.float()) / math.sqrt(h.shape[-1])  # [B, T]
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=1)  # [B, T]
        return torch.einsum("bt,btd->bd", weights, h)

    def _check_inputs(self, hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
        if hidden.dim() != 3:
            raise ValueError(f"hidden: expected [batch, tokens, hidden] (3-D), got shape {tuple(hidden.shape)}")
        b, t, d = hidden.shape
        if d != self.config.hidden_size:
            raise ValueError(f"hidden: last dim {d} does not match the head's hidden_size "
                             f"{self.config.hidden_size} (a head trained for another model?)")
        if t == 0:
            raise ValueError("hidden: has zero tokens; a head needs at least one real token per input")
        if not hidden.is_floating_point():
            raise ValueError(f"hidden: expected a float tensor, got {hidden.dtype}")
        if attention_mask is None:
            return torch.ones(b, t, dtype=torch.bool, device=hidden.device)
        if tuple(attention_mask.shape) != (b, t):
            raise ValueError(f"attention_mask: expected shape {(b, t)} to match hidden, "
                             f"got {tuple(attention_mask.shape)}")
        # checked where the mask lives: a host mask (a server's, built from prompt lengths) is checked
        # on the host and moved without waiting for the GPU; a device mask costs one wait
        mask = attention_mask != 0
        empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"attention_mask: rows {empty} have no real token (all zeros)")
        if mask.device.type == "cpu" and hidden.is_cuda:
            mask = mask.pin_memory()
        return mask.to(hidden.device, non_blocking=True)

    def extra_repr(self) -> str:
        c = self.config
        return f"type={c.type}, hidden_size={c.hidden_size}, pooling={c.pooling}, outputs={c.num_outputs}"
