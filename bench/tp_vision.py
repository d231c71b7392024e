"""The tensor-parallel benchmark's vision encoder ops (bench/tp_rank.py runs them on every rank).

`op_vision(engine, job, images, mode)` times the engine's encoder on `images` prompts' pictures
with the tower run `mode` ("split": each rank its share, then one all-gather; "whole": every rank
every item; TP=1 is always the whole tower). For "split" it also breaks three calls down on every
rank with CUDA events around the rank's own tower pass: the tower's device time, the time from the
tower's end to the all-gather's end (the transfer plus any wait for a later rank), and the host
time of the call, so a rank whose host or device lags shows as its peers' gather time.
`op_vision_profile(engine, job, images, rank)`: one call of the split encoder under torch.profiler
on rank 0 (kernels on a GPU, operators on the CPU): tower, all-gather and idle time.

Every rank makes the same calls in the same order (the all-gathers pair up), as in bench/tp_rank.py.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from serve.engine import Request, SamplingParams

from .engine import _prompts
from .step_profile import profile_on_rank0

COMM_MARKS = ("nccl", "all_gather", "allgather", "gloo")  # the all-gather's kernels (GPU) or operators (CPU)


def vision_items(engine, job, images: int) -> list:
    """The prepared vision items of `images` bench prompts (one picture each), as every rank makes them."""
    params = SamplingParams(max_tokens=1, detokenize=False)
    return [it for text, image in _prompts(job, engine.tokenizer, images, 50_000)
            for it in engine.prepare(Request(prompt=text, images=[image], sampling=params))[0].vision]


def _cuda(engine) -> bool:
    return str(engine.config.device).startswith("cuda")


@contextlib.contextmanager
def tower_mode(vision, mode: str):
    """The tensor-parallel tower (serve.models.parallel.SplitVision) run as `mode` for a while; a
    single engine's tower has no mode (it is the whole tower)."""
    if not hasattr(vision, "mode"):
        yield "whole"
        return
    before, vision.mode = vision.mode, mode
    try:
        yield mode
    finally:
        vision.mode = before


def op_vision(engine, job, images: int, mode: str = "split") -> dict:
    """ms of the engine's vision encoder on `images` prompts' pictures (one call), how many items this
    rank encoded itself and, for "split" on a group, where each rank's time went (`_split_parts`)."""
    from .tp_rank import _time_ms

    items = vision_items(engine, job, images)
    vision = engine.model.vision
    with tower_mode(vision, mode) as ran:
        before = getattr(vision, "items_here", None)
        ms = _time_ms(lambda: engine.model.encode(items), 2, job.vision_repeats, _cuda(engine))
        calls = 2 + 1 + job.vision_repeats
        here = len(items) if before is None else (vision.items_here - before) // calls
        parts = _split_parts(engine, items) if ran == "split" else {}
    return dict(tp_vision=ran, vision_ms=ms, items=len(items), items_here=here,
                vision_tokens=sum(it.num_tokens for it in items), **parts)


class _Marked(nn.Module):
    """The rank's own tower pass, marked where it ends: (host time, CUDA event or None) per call."""

    def __init__(self, inner: nn.Module, marks: list, cuda: bool):
        super().__init__()
        self.inner, self.marks, self.cuda = inner, marks, cuda

    def forward(self, items):
        out = self.inner(items)
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((time.perf_counter(), event))
        return out


def _split_parts(engine, items: list, calls: int = 3) -> dict:
    """Medians over `calls` split calls on this rank, and the slowest other rank's, ms:
    tower_ms (the call's start to the end of the rank's own tower pass on the device, launch gaps
    included; host time on the CPU), gather_ms (the tower's end to the all-gather's end: the
    transfer plus any wait for a later rank), host_ms (the call's host time: launches and host
    work, the GPU running behind) and host_tower_ms (host time until the rank's tower pass was
    launched); gather_min_ms, the least gather_ms of all ranks: the all-gather's own time, as the
    rank that reached it last saw it. Collective: every rank calls it with the same items."""
    vision, cuda = engine.model.vision, _cuda(engine)
    marks: list = []
    inner = vision.inner
    vision.inner = _Marked(inner, marks, cuda)
    samples = []
    try:
        for _ in range(calls):
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            engine.model.encode(items)
            t1 = time.perf_counter()
            if cuda:
                end.record()
                end.synchronize()
            t2 = time.perf_counter()
            mark_host, mark = marks[-1]
            tower = start.elapsed_time(mark) if cuda else (mark_host - t0) * 1e3
            gather = mark.elapsed_time(end) if cuda else (t2 - mark_host) * 1e3
            samples.append((tower, gather, (t1 - t0) * 1e3, (mark_host - t0) * 1e3))
    finally:
        vision.inner = inner
    names = ("tower_ms", "gather_ms", "host_ms", "host_tower_ms")
    mine = {n: statistics.median(s[i] for s in samples) for i, n in enumerate(names)}
    tp = engine.model.tp
    every = [None] * tp.world_size
    dist.all_gather_object(every, mine, group=tp.control if tp.control is not None else tp.group)
    peers = [p for r, p in enumerate(every) if r != tp.rank]
    slowest = {f"peer_{n}": max(p[n] for p in peers) for n in ("tower_ms", "host_ms", "host_tower_ms")}
    return dict(mine, gather_min_ms=min(p["gather_ms"] for p in every), **slowest)


def op_vision_profile(engine, job, images: int, rank: int) -> dict:
    """Rank 0: one call of the encoder ("split" on a group) under torch.profiler after one warm-up
    call: the tower's kernels, the all-gather's and the idle share of the call's span; the other
    ranks make the same two calls unprofiled."""
    items = vision_items(engine, job, images)
    cuda = _cuda(engine)

    def call():
        engine.model.encode(items)

    with tower_mode(engine.model.vision, "split") as ran:
        prof = profile_on_rank0(call, rank, 1, cuda)
    if rank != 0:
        return prof
    if "error" in prof:
        return dict(tp_vision=ran, **prof)
    comm = [k for k in prof["kernels"] if any(m in k["name"].lower() for m in COMM_MARKS)]
    comm_us = sum(k["us"] for k in comm)
    tower = [k for k in prof["kernels"] if k not in comm]
    top = ", ".join(f"{k['name'][:48]} {k['us'] / 1e3:.1f}" for k in tower[:3])
    return dict(tp_vision=ran, what="kernels" if cuda else "cpu operators", span_us=prof["span_us"],
                tower_us=prof["busy_us"] - comm_us, comm_us=comm_us,
                idle_us=max(0.0, prof["span_us"] - prof["busy_us"]), top_tower_ms=top)
