"""Next-token sampling for a batch with per-request parameters.

Greedy rows take the argmax. Sampled rows divide by their temperature, cut to their top-k and
top-p sets and draw with the exponential race `argmax(p / E)`, E ~ Exp(1): one draw per row,
from the row's own generator when the request has a seed (so its tokens do not depend on what
else is in the batch), otherwise from the engine's generator.
"""

from __future__ import annotations

import torch

from .request import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] float32; top_k: int64 [N] (0 = off); top_p: float32 [N] -> masked logits."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    cut = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    probs = sorted_logits.softmax(-1)
    # drop a token when the more likely ones already reach top_p (the top token always stays)
    cut = (probs.cumsum(-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           default_generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: [N, V] -> int64 [N] next tokens (on the logits' device)."""
    logits = logits.float()
    tokens = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens
    device = logits.device
    index = torch.tensor(rows, device=device)
    sub = logits[index] / torch.tensor([params[i].temperature for i in rows], device=device)[:, None]
    top_k = torch.tensor([params[i].top_k for i in rows], device=device)
    top_p = torch.tensor([params[i].top_p for i in rows], device=device, dtype=torch.float32)
    probs = apply_top_k_top_p(sub, top_k, top_p).softmax(-1)
    race = torch.empty_like(probs)
    unseeded = [j for j, i in enumerate(rows) if generators[i] is None]
    if unseeded:
        race[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_(
            generator=default_generator)
    for j, i in enumerate(rows):
        if generators[i] is not None:
            race[j].exponential_(generator=generators[i])
    tokens[index] = (probs / race).argmax(-1)
    return tokens
