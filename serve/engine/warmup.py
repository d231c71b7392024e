"""Warm-up: the engine runs the shapes serving will meet before anyone is told it is ready.

A cold GPU engine compiles on first use: Triton kernels per tiling bucket and specialisation (the
LoRA shrink/expand tiles per token bucket, the paged and segment attention), the merge kernel the
first time a policy folds an adapter in, cuBLAS heuristics per GEMM shape, the head batches. Hit by
many cameras at once, each of those compiles stalls a step that already carries every camera's
chunk, and the backlog never drains (a 24-camera point right after start answered 26 of 72 chunks,
p95 6.6 s, where a warm server holds p95 0.3 s).

So before the server takes work, the engine serves waves of made-up requests through its own
`add_request` / `step` path: 1, 2, 4, ... up to `max_batch_size` requests at once, each with a
picture (a video chunk on Qwen models, an image on LLaVA) of noise that no cache can answer,
spread over the base model and every loaded adapter, in head mode for adapters with a head and as a
few generated tokens otherwise, then the same waves on one adapter alone (the policy may fold it
in). A server that starts with no adapter and a policy that folds them runs those waves on a made-up
adapter (random A, zero B: `AdapterManager.load_made_up`), unloaded before serving: tenants load theirs
at run time, and the first one a policy folded in compiled the merge kernel for 14-17 s on an H200
while its request waited. That walks the prefill token buckets, chunked prefill, mixed prefill + decode steps, the
decode batch sizes, the head batches and the adapter mixes the policy turns into modes. Before them,
every LoRA kernel variant a live step can look up is compiled by a sweep of made-up batches
(serve/engine/warmup_lora.py): the waves alone left some for the first live seconds. Between the
two, the vision tower runs on every pack size live steps can hand it (`pack_sizes`: 1 to 16 items,
then each multiple of 16 and its neighbours), where the waves give it multiples of a request's
pictures only. Last, the decode batch sizes run once more with the decode graphs set aside, for the
steps no graph takes. Kernels still compiled after all this are logged by serve/engine/compile_watch.py. The caches
the waves filled are dropped afterwards; the step log keeps them (marked by `warm_report`). The whole
warm-up records the towers' attention shapes, and after the packs every segment count up to the
largest is planned (serve/forward/segment_plans.py): live steps then plan none.

`warm_up(engine)` returns where the time went, per phase, which `vlora serve` logs and the health
reply carries.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from serve.forward import segment_plans
from .warmup_lora import sweep_lora_kernels

log = logging.getLogger("vlora.serve.engine")

MODES = ("auto", "on", "off")


@dataclass
class WarmReport:
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    requests: int = 0
    steps: int = 0
    heap_objects: int = 0  # objects the collector tracked at the end (GPU: before they were frozen)
    attention_plans: int = 0  # tower attention shapes built by the sweep (GPU)

    def to_dict(self) -> dict:
        return {"seconds": round(self.seconds, 3), "phases": {k: round(v, 3) for k, v in self.phases.items()},
                "requests": self.requests, "steps": self.steps, "heap_objects": self.heap_objects,
                "attention_plans": self.attention_plans}

    def line(self) -> str:
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in self.phases.items())
        return f"warmed up in {self.seconds:.1f} s ({self.requests} requests, {self.steps} steps: {parts})"


def wanted(mode: str, device_type: str) -> bool:
    """auto: on a GPU only (a CPU compiles nothing lazily that a warm-up would save)."""
    if mode not in MODES:
        raise ValueError(f"warm_up={mode!r}: use one of {list(MODES)}")
    return mode == "on" or (mode == "auto" and device_type == "cuda")


def wave_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, ... and max_batch_size itself: every decode-graph bucket and head batch gets a wave."""
    sizes, n = [], 1
    while n < max_batch_size:
        sizes.append(n)
        n *= 2
    return sizes + [max_batch_size]


def _picture(engine, rng: np.random.Generator, side, frames: int) -> dict:
    """Noise (never the same twice, so neither the encoder cache nor the prefix cache answers it).
    An engine that decodes JPEG on its device (pixels=device) gets JPEG frames, as the server hands
    it cameras' frames: the decoder's first use is part of what a cold server pays."""
    width, height = (side, side) if isinstance(side, int) else side  # a square side, or (width, height)
    if engine.model.args.is_qwen:
        clip = rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
        if getattr(engine.processor, "pixel_spec", None) is not None:
            import cv2

            return {"video": [cv2.imencode(".jpg", f, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes() for f in clip]}
        return {"video": clip}
    return {"images": [rng.integers(0, 256, (height, width, 3), dtype=np.uint8)]}


def pack_sizes(max_vision_batch: int) -> list[int]:
    """Items per vision-tower call the warm-up runs: every count to 16, then each multiple of 16 and its
    neighbours up to the limit (a kernel may be specialised for a count of 1, or one divisible by 16)."""
    sizes = set(range(1, 17))
    sizes |= {m for k in range(1, max_vision_batch // 16 + 1) for m in (16 * k - 1, 16 * k, 16 * k + 1)}
    return sorted(x for x in sizes if 1 <= x <= max_vision_batch)


def _tower_packs(engine, rng: np.random.Generator, side, frames: int) -> int:
    """The vision tower on 1, 2, ... items per call (pack_sizes): live steps hand it any count of
    pictures, the waves only multiples of a request's. Returns the calls made."""
    import torch

    sizes = pack_sizes(engine.config.max_vision_batch)
    items: list = []
    while len(items) < sizes[-1]:  # pictures as requests bring them (JPEG frames where the device decodes)
        prompt, _, _ = engine.prepare(_request_of(engine, rng, side, frames))
        items.extend(prompt.vision)
    with torch.no_grad():
        for n in sizes:
            engine.model.encode(items[:n])
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return len(sizes)


def _request_of(engine, rng, side, frames: int):
    from .request import Request

    return Request(prompt="What is in this picture?", **_picture(engine, rng, side, frames))


def _targets(engine) -> list[tuple[str | None, str | None]]:
    """(adapter, head domain or None) of every loaded adapter, and the base model (None, None)."""
    out: list[tuple[str | None, str | None]] = [(None, None)]
    for info in engine.list_adapters():
        heads = info.get("heads") or {}
        out.append((info["name"], next(iter(heads), None)))
    return out


MADE_UP_ADAPTER = "__warm_up__"  # the warm-up's adapter when none is loaded at start, unloaded before serving


def may_merge(engine) -> bool:
    """Whether a policy may fold an adapter into the weights of this engine (modes enabled)."""
    return engine.lora is not None and engine.planner.policy is not None and engine.lora.merger is not None


def _run_wave(engine, requests) -> int:
    """Adds every request, steps until they are done; returns the steps taken."""
    ids = [engine.add_request(r) for r in requests]
    steps, open_ids = 0, set(ids)
    while open_ids:
        for out in engine.step():
            if out.finished:
                open_ids.discard(out.request_id)
        steps += 1
        if steps > 100_000:  # a wave that never ends is a bug to report, not a start-up that hangs
            raise RuntimeError(f"warm-up: {len(open_ids)} request(s) unfinished after {steps} steps")
    return steps


def warm_up(engine, side: int = 448, frames: int = 6, answer_tokens: int = 4, seed: int = 0,
            sizes: tuple = ()) -> WarmReport:
    """Runs the waves on `engine` (whose step loop must not be running elsewhere); returns the report.
    Pictures are `frames` square frames of `side` pixels; `sizes`, more (width, height) the tower packs
    also run at (cameras of other sizes: Qwen's tower shapes follow the picture, CLIP's do not).
    Call it on the thread that will step the engine: the towers' attention plans are per thread."""
    with segment_plans.recording():  # every tower attention shape met here is planned for this thread
        return _warm_up(engine, side, frames, answer_tokens, seed, tuple(sizes))


def _warm_up(engine, side: int, frames: int, answer_tokens: int, seed: int, more_sides: tuple) -> WarmReport:
    from .request import Request, SamplingParams

    rng = np.random.default_rng(seed)
    report = WarmReport()
    start = time.perf_counter()
    sampling = SamplingParams(max_tokens=answer_tokens, ignore_eos=True, detokenize=False)
    targets = _targets(engine)
    sizes = wave_sizes(engine.config.max_batch_size)

    def request(adapter, domain, i) -> Request:
        head = domain is not None and i % 2 == 0  # adapters with a head: half head answers, half tokens
        # each request its own connection and tenant: the scheduler shares a step's tokens out between
        # tenants, so the steps come in the partial-prompt mixes that several tenants' live traffic makes
        # (one tenant's requests are prefilled whole in arrival order: a subset of these sizes)
        rid = f"warm-up-{report.requests + i}"
        return Request(prompt="What is in this picture?", adapter=adapter, output_mode="head" if head else "generate",
                       task=domain if head else None, sampling=sampling, request_id=rid, owner=rid, tenant=rid,
                       app="warm-up", **_picture(engine, rng, side, frames))

    def phase(name: str, waves) -> None:
        t0 = time.perf_counter()
        for wave in waves:
            report.steps += _run_wave(engine, wave)
            report.requests += len(wave)
        report.phases[name] = report.phases.get(name, 0.0) + time.perf_counter() - t0

    t0 = time.perf_counter()  # every LoRA kernel variant live steps can look up (warmup_lora.py)
    if sweep_lora_kernels(engine):
        report.phases["lora kernels"] = time.perf_counter() - t0
    # every adapter and the base model in each wave: the mixes unmerged / mixture steps see
    phase("mixed waves", ([request(*targets[i % len(targets)], i) for i in range(n)] for n in sizes))
    t0 = time.perf_counter()  # every pack size of the tower, before live steps hand it one the waves did not
    _tower_packs(engine, rng, side, frames)
    for more in more_sides if engine.model.args.is_qwen else ():
        _tower_packs(engine, rng, more, frames)
    report.phases["tower packs"] = time.perf_counter() - t0
    if engine.device.type == "cuda":  # the attention plan of every segment count up to the largest pack's
        t0 = time.perf_counter()
        report.attention_plans = segment_plans.sweep()
        report.phases["attention plans"] = time.perf_counter() - t0
    adapted = [t for t in targets if t[0] is not None]
    made_up = not adapted and may_merge(engine)
    if made_up:  # tenants load adapters later: the first one a policy folds in must not compile while served
        engine.lora.load_made_up(MADE_UP_ADAPTER, seed=seed)
        adapted = [(MADE_UP_ADAPTER, None)]
    if adapted:  # one adapter alone: what a policy folds into the weights (the merge kernels too)
        phase("one-adapter waves", ([request(*adapted[0], i) for i in range(n)] for n in sizes))
    if made_up:
        engine.unload_adapter(MADE_UP_ADAPTER)
    graphs = engine.runner.graphs
    if graphs is not None:  # decode steps no graph takes (a context past the graphs' blocks) launch kernels of
        engine.runner.graphs = None  # their own: an H200 compiled the split decode attention for 17 s mid-request
        try:
            phase("eager decode", ([Request(prompt="Say something.", sampling=sampling, owner=f"e{i}",
                                            request_id=f"warm-up-eager-{n}-{i}", app="warm-up") for i in range(n)]
                                   for n in sizes))
        finally:
            engine.runner.graphs = graphs
    engine.drop_caches()  # noise is nobody's prefix or picture
    if engine.device.type == "cuda":
        _settle_heap(report)
    report.seconds = time.perf_counter() - start
    return report


def _settle_heap(report: WarmReport) -> None:
    """Collects the warm-up's garbage, then exempts what survives from later collections (gc.freeze).

    Compiling hundreds of kernel variants leaves a large heap of long-lived objects behind (Triton's,
    Inductor's). A full collection walks every tracked object, and Python starts one when enough new
    objects have survived since the last: one such walk during serving stalls a step that carries
    every camera's chunk. Frozen objects are still freed by reference counting. On a GPU only: a
    server process builds one engine; tests build many on the CPU, where freezing would keep each
    engine's cycles for the life of the process."""
    t0 = time.perf_counter()
    report.heap_objects = len(gc.get_objects())
    gc.collect()
    gc.freeze()
    report.phases["heap"] = time.perf_counter() - t0
