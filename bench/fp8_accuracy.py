"""Accuracy of one engine's greedy outputs against a reference engine's on the same prompts (bench/fp8.py).

Both sides decode greedily from the same prompt, so their histories are the same up to the first
token they choose differently: logits are compared at every position up to and including that one
(at the divergence itself both still saw the same tokens) and never after it. Reported:

    logit_max_abs_err    largest |logit - ref logit| over those positions and the vocabulary
    logit_rel_err        the same over the largest |ref logit| at the position (scale-free)
    logit_mean_abs_err   mean |logit - ref logit|
    token_agreement      share of the reference's tokens matched at the same position
    diverged             prompts whose tokens differ anywhere; first_divergence_* their first index
    margin_*             at the first divergence, ref logit of the ref's token minus ref logit of
                         the other side's token: how near the reference itself was to that choice
"""

from __future__ import annotations

import statistics


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def compare_outputs(ref: list, got: list) -> dict:
    """ref, got: RequestOutputs of the same requests (token_ids and logits kept)."""
    max_abs, rel, means, agree, total, firsts, margins = 0.0, 0.0, [], 0, 0, [], []
    for r, g in zip(ref, got):
        first = _first_divergence(r.token_ids, g.token_ids)
        upto = len(r.token_ids) if first is None else first + 1
        for pos in range(min(upto, len(r.logits), len(g.logits))):
            a, b = r.logits[pos].float(), g.logits[pos].float()
            diff = (b - a).abs()
            max_abs = max(max_abs, diff.max().item())
            rel = max(rel, (diff.max() / a.abs().max().clamp_min(1e-12)).item())
            means.append(diff.mean().item())
        agree += sum(x == y for x, y in zip(r.token_ids, g.token_ids))
        total += len(r.token_ids)
        if first is not None:
            firsts.append(first)
            ref_logits = r.logits[first].float()
            margins.append((ref_logits[r.token_ids[first]] - ref_logits[g.token_ids[first]]).item())
    return dict(logit_max_abs_err=max_abs, logit_rel_err=rel,
                logit_mean_abs_err=statistics.mean(means) if means else float("nan"),
                token_agreement=agree / total if total else float("nan"), prompts=len(ref), diverged=len(firsts),
                first_divergence_min=min(firsts) if firsts else None,
                first_divergence_median=statistics.median(firsts) if firsts else None,
                margin_min=min(margins) if margins else None,
                margin_median=statistics.median(margins) if margins else None)


def projection_bytes(engine) -> int:
    """Bytes of the language model's projection weights (with FP8 scales and biases)."""
    total = 0
    for _, _, module in engine.model.language_model.projections():
        base = getattr(module, "base", module)
        total += sum(t.numel() * t.element_size() for t in base.parameters())
    return total

