"""Benchmark and search workloads: adapter mixes over a batch, the pools they need, and each
op's floor (the fewest bytes it must move and the arithmetic it must do).

A batch of T tokens is min(T, 64) requests of (nearly) equal length, each request using one
adapter chosen by the mix:
    distinct   every request its own adapter
    uniform    ceil(sqrt(requests)) adapters, requests spread evenly over them
    skewed     Zipf(1.5) popularity over `requests` adapters (a few hot ones, a long tail)
    identical  one adapter for the whole batch
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

MIXES = ("distinct", "uniform", "skewed", "identical")
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # what the ATMM kernels take
MAX_REQUESTS = 64


def token_slots(n_tokens: int, mix: str, seed: int = 0, max_requests: int = MAX_REQUESTS) -> list[int]:
    """Per-token adapter slots of a batch (requests contiguous, as the engine lays them out)."""
    if mix not in MIXES:
        raise ValueError(f"mix {mix!r} is not one of {MIXES}")
    n_req = min(n_tokens, max_requests)
    if mix == "distinct":
        per_request = np.arange(n_req)
    elif mix == "uniform":
        per_request = np.arange(n_req) % math.ceil(math.sqrt(n_req))
    elif mix == "skewed":
        weights = 1.0 / np.arange(1, n_req + 1) ** 1.5
        per_request = np.random.default_rng(seed).choice(n_req, size=n_req, p=weights / weights.sum())
    else:
        per_request = np.zeros(n_req, dtype=np.int64)
    lengths = np.full(n_req, n_tokens // n_req) + (np.arange(n_req) < n_tokens % n_req)
    return np.repeat(per_request, lengths).astype(int).tolist()


def longest_segment(n_tokens: int, mix: str) -> int:
    """Tokens of the most used adapter: the batch's longest segment once grouped by slot."""
    slots = token_slots(n_tokens, mix)
    return max(slots.count(s) for s in set(slots))


@dataclass(frozen=True)
class LoRAShape:
    tokens: int
    mix: str
    rank: int
    k: int  # input features
    slices: tuple[int, ...]  # output widths

    @property
    def n(self) -> int:
        return sum(self.slices)


def make_problem(shape: LoRAShape, dtype=torch.float16, device="cuda", seed: int = 0, n_slots: int = MAX_REQUESTS):
    """Random (never zero) inputs of one benchmark shape: (y, x, lora_a, lora_b, slot_ids, ranks, scales)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    slot_ids = token_slots(shape.tokens, shape.mix, seed)
    kw = dict(dtype=dtype, device=device)
    x = torch.randn(shape.tokens, shape.k, generator=g).to(**kw)
    y = torch.randn(shape.tokens, shape.n, generator=g).to(**kw)
    lora_a = (torch.randn(len(shape.slices), n_slots, shape.rank, shape.k, generator=g) / shape.k**0.5).to(**kw)
    lora_b = (torch.randn(n_slots, shape.n, shape.rank, generator=g) / shape.rank**0.5).to(**kw)
    ranks = torch.full((len(shape.slices), n_slots), shape.rank, dtype=torch.int32, device=device)
    scales = torch.full((n_slots,), 2.0, dtype=torch.float32, device=device)
    return y, x, lora_a, lora_b, slot_ids, ranks, scales


def floor_cost(shape: LoRAShape, op: str = "lora", elem_bytes: int = 2) -> tuple[float, float]:
    """(flops, bytes) the op must at least do and move: inputs read once, outputs written once,
    each distinct adapter's weights read once; v (fp32) written by the shrink, read by the expand."""
    distinct = len(set(token_slots(shape.tokens, shape.mix)))
    t, k, n, r, s = shape.tokens, shape.k, shape.n, shape.rank, len(shape.slices)
    v_bytes = s * t * r * 4
    shrink = (2 * t * r * k * s, t * k * elem_bytes + s * distinct * r * k * elem_bytes + v_bytes)
    expand = (2 * t * r * n, v_bytes + distinct * n * r * elem_bytes + 2 * t * n * elem_bytes)
    if op == "shrink":
        return shrink
    if op == "expand":
        return expand
    return shrink[0] + expand[0], shrink[1] + expand[1]


def copies_to_defeat_cache(shape: LoRAShape, l2_bytes: int, most: int = 16) -> int:
    """How many independent problem copies to rotate through so that the timed working set is
    several times the L2 cache: otherwise small adapters stay in cache between repeats and the
    timing measures the cache, not memory."""
    _, n_bytes = floor_cost(shape)
    return max(1, min(most, math.ceil(4 * l2_bytes / max(n_bytes, 1))))


class Rotation:
    """A zero-argument callable that runs `step(problem)` on the next of several problems."""

    def __init__(self, problems: list, step):
        self.problems, self.step, self.i = problems, step, 0

    def __call__(self):
        problem = self.problems[self.i % len(self.problems)]
        self.i += 1
        return self.step(problem)
