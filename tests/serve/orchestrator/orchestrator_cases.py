"""Shared builders for the orchestrator tests: an affine cost profile and scripted requests."""

from __future__ import annotations

from serve.orchestrator import CostProfile, Grid2D, Mode, RequestView, StepView


def affine(rows, cols, fn) -> Grid2D:
    return Grid2D([float(r) for r in rows], [float(c) for c in cols], [[fn(r, c) for c in cols] for r in rows])


def linear_profile(switch_ms: float = 5.0) -> CostProfile:
    """Affine in every axis, so bilinear interpolation is exact and estimates are easy to check by hand:
    base 10 + 0.01/token + 0.1/seq; ATMM 2 + 0.5/adapter + 0.001/token; deLoRA twice ATMM's token term."""
    rows, cols = [1, 1024], [1, 65536]
    return CostProfile(
        base=affine(rows, cols, lambda s, t: 10 + 0.01 * t + 0.1 * s),
        lora={"atmm": affine(rows, cols, lambda a, t: 2 + 0.5 * a + 0.001 * t),
              "delora": affine(rows, cols, lambda a, t: 2 + 0.5 * a + 0.002 * t),
              "einsum": affine(rows, cols, lambda a, t: 8 + 2 * a + 0.004 * t)},
        switch_ms={"atmm": switch_ms, "addmm": 10 * switch_ms}, name="linear-test")


def req(rid: str, adapter: str | None, arrival_ms: float, prompt: int = 100, out: int = 10, **kw) -> RequestView:
    return RequestView(rid, adapter, arrival_ms, prompt, out, **kw)


def view(now: float, waiting=(), running=(), mode: Mode | None = None, max_batch_size: int = 8,
         max_tokens_per_step: int = 4096) -> StepView:
    return StepView(now, tuple(waiting), tuple(running), mode or Mode.unmerge(), max_batch_size, max_tokens_per_step)
