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


# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom; the normal 1.96 past 30.
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281, 2.2010, 2.1788,
         2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860, 2.0796, 2.0739, 2.0687, 2.0639,
         2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """The mean of `values` (e.g. one paired difference per seed) and its 95% t interval: whether
    several runs resolve a difference between two methods, or leave it inside the spread."""
    n = len(values)
    if n < 2:
        raise ValueError(f"an interval of a mean needs at least two values, got {n}")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * sd / math.sqrt(n)
    return mean, mean - half, mean + half
