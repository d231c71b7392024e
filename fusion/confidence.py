"""How far a fusion verdict can be trusted: a score's 95% interval over the eval items it was
measured on, and whether a requirement lies inside it (another draw of eval items could then
turn the verdict). Used by the offline and demo reports and the seeds table."""

from __future__ import annotations

import math


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% at z = 1.96) of a share `p` of `n` items."""
    if n <= 0:
        raise ValueError(f"an interval needs at least one item, got n={n}")
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def score_interval(task: str, accuracy: float, n: int) -> str | None:
    """A score's 95% interval over its eval items, as "lo-hi"; None for detect, whose F1 is no
    share of items (no binomial interval), or without items."""
    if task == "detect" or n <= 0:
        return None
    lo, hi = wilson(accuracy, n)
    return f"{lo:.3f}-{hi:.3f}"


def requirement_within(interval: str | None, requirement: float) -> bool:
    """Whether `requirement` lies inside an interval "lo-hi" (False without one)."""
    if not interval:
        return False
    lo, hi = (float(v) for v in interval.split("-"))
    return lo < requirement <= hi
