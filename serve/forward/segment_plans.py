"""Which equal-length segment shapes the towers' batched attention may take, per thread, and warming them.

On a GPU, `scaled_dot_product_attention` serves a step's equal-length segments with cuDNN's fused
attention, and cuDNN builds an execution plan the first time a thread meets a shape (segment count,
length, strides): tens of milliseconds of host time each, while the device waits. The count is the
number of frame groups (or windows) in a tower call, which live steps vary freely; a count the warm-up
never ran cost its build inside a step that carried every camera's chunk (on an H200 at 36 cameras,
a cold server's first steps spent 47-113 ms of host time in cuDNN's attention against 4-5 ms once the
shapes were known).

So on CUDA the batched call is taken only for shapes this thread has already run (`known`); any other
shape goes to the variable-length flash kernel, which plans nothing per shape. The engine's warm-up
runs on the serving thread inside `recording()`, which makes every shape its tower calls meet known
and notes their layouts; `sweep()` then runs each layout at every count up to the largest met, in
steps of the smallest (a picture's windows come together), so live steps find their shapes built.
Thread-local because cuDNN's plan cache is: a shape built on another thread is built again here.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F

_local = threading.local()
log = logging.getLogger("vlora.serve.forward")


def _state() -> dict:
    state = getattr(_local, "state", None)
    if state is None:
        state = _local.state = {"known": set(), "layouts": {}, "recording": False, "planned_calls": 0,
                                "unplanned_calls": 0, "unwarmed": set()}
    return state


def equal_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """q, k, v: [count * length, heads, dim], `count` segments of `length` rows back to back, each
    attending within itself -> [count * length, heads, dim]; one batched call."""
    shape = (count, length) + tuple(q.shape[1:])
    o = F.scaled_dot_product_attention(*(t.reshape(shape).transpose(1, 2) for t in (q, k, v)))
    return o.transpose(1, 2).reshape(count * length, *q.shape[1:])


def shape_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, count: int) -> tuple:
    """What the attention's plan depends on: the count, and the rest (`layout`) that a tower call's
    segment length, tensor strides, dtype and device fix."""
    layout = (length, tuple(q.shape[1:]), q.stride(), k.stride(), v.stride(), q.dtype, q.device)
    return (count,) + layout


def known(key: tuple) -> bool:
    """True when this thread has run the shape (and, while recording, makes it so). A live call at a
    segment length the warm-up never met is a picture size it did not run: said once per length."""
    state = _state()
    count, layout = key[0], key[1:]
    if state["recording"]:
        state["known"].add(key)
        low, high = state["layouts"].get(layout, (count, count))
        state["layouts"][layout] = (min(low, count), max(high, count))
        return True
    if key in state["known"]:
        state["planned_calls"] += 1
        return True
    state["unplanned_calls"] += 1
    if state["layouts"] and layout not in state["layouts"] and layout not in state["unwarmed"]:
        state["unwarmed"].add(layout)
        log.warning("vision tower: segments of %d rows, which the warm-up did not run, take the varlen attention "
                    "kernel (a little slower than a planned one); a camera of another size? add it to "
                    "engine.warm_up_sizes", layout[0])
    return False


def stats() -> dict:
    """This thread's plans and how its live tower calls fared: batched at a planned shape, or varlen at an
    unplanned one (`unwarmed_lengths`: segment lengths the warm-up never met)."""
    state = _state()
    return {"plans": len(state["known"]), "planned_calls": state["planned_calls"],
            "unplanned_calls": state["unplanned_calls"],
            "unwarmed_lengths": sorted({layout[0] for layout in state["unwarmed"]})}


def is_recording() -> bool:
    return _state()["recording"]


@contextmanager
def recording():
    """Within: every batched shape met is run as batched and noted (the warm-up's tower calls)."""
    state = _state()
    was, state["recording"] = state["recording"], True
    try:
        yield
    finally:
        state["recording"] = was


def _strided(rows: int, like: torch.Tensor, stride: tuple) -> torch.Tensor:
    """A [rows, heads, dim] tensor of zeros with `stride`, as the live call's views have."""
    heads, dim = like[0], like[1]
    size = (rows - 1) * stride[0] + (heads - 1) * stride[1] + (dim - 1) * stride[2] + 1
    return like[2].new_zeros(size).as_strided((rows, heads, dim), stride)


@torch.no_grad()
def sweep(max_builds: int = 4096) -> int:
    """Runs every noted layout at each count from its smallest to its largest, in steps of the smallest;
    returns the shapes newly built (at most `max_builds`)."""
    state = _state()
    built = 0
    for layout, (low, high) in list(state["layouts"].items()):
        length, (heads, dim), sq, sk, sv, dtype, device = layout
        for count in range(low, high + 1, low):
            key = (count,) + layout
            if key in state["known"] or built >= max_builds:
                continue
            rows = count * length
            like = (heads, dim, torch.empty(0, dtype=dtype, device=device))
            equal_segments(_strided(rows, like, sq), _strided(rows, like, sk), _strided(rows, like, sv), length, count)
            state["known"].add(key)
            built += 1
    return built


def forget() -> None:
    """This thread's record emptied (tests; a thread that serves a new engine)."""
    _local.state = None
