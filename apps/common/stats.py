"""Latency percentiles as the applications, the load test and the streams benchmark report them."""

from __future__ import annotations

import math

import numpy as np


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100, linear interpolation as numpy's default); NaN for no values."""
    values = list(values)
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else math.nan


def percentiles(values, qs=(50, 95, 99)) -> dict[str, float | None]:
    """p50 / p95 / p99 (linear interpolation, numpy's default) and the mean, in the values' unit."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return {**{f"p{q}": None for q in qs}, "mean": None}
    return {**{f"p{q}": round(percentile(arr, q), 2) for q in qs}, "mean": round(float(arr.mean()), 2)}
