"""The streams workload on the engine in process (no RPC): where a served chunk's time goes.

- full batch: `job.max_batch_size` chunks submitted at once and stepped until all are answered:
  chunks/s, steps, the share of the wall the GPU runs kernels or copies (profiler), the GPU span of
  the vision calls (CUDA events) and the rest per chunk, host syncs per step and where they come
  from (torch's sync debug mode);
- paced: chunks arriving at `rates` per second for `seconds` (prepared on the stepping thread, as
  an upper bound of the loop's own cost): served chunks/s, p50/p95 latency, mean step ms and the
  largest number of sequences a step carried, to see whether throughput holds past capacity.
Head mode (one forward pass per chunk), JPEG frames as the server receives them.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch

from apps.common.stats import percentile
from vlora_kernels.timing import host_syncs

from .streams_load import HEAD_TASK, _stamped


def _requests(job, chunks, names, count: int, start: int):
    from serve import Request, SamplingParams
    from serve.rpc.wire import encode_frame

    out = []
    for i in range(count):
        frames = _stamped(chunks[(start + i) % len(chunks)], start + i + 1, not job.static_camera)
        jpegs = [encode_frame(f, "jpeg")[1] for f in frames]  # as the cameras send them
        out.append(Request(prompt=job.prompt, video=jpegs, adapter=names[i % len(names)], task=HEAD_TASK,
                           output_mode="head", sampling=SamplingParams(max_tokens=1)))
    return out


def _drain(engine) -> int:
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def _kernel_ms(prof) -> float:
    """GPU kernel and copy time of a profile (its own annotations, which span time, left out)."""
    from torch.autograd import DeviceType

    return sum(e.time_range.elapsed_us() for e in prof.events()
               if e.device_type == DeviceType.CUDA and not e.name.startswith("vlora::")) / 1e3


def kernel_kinds(prof, chunks: int, cuda: bool = True) -> tuple[dict, list[dict]]:
    """The profile's GPU kernels (with cuda=False its outermost CPU operators) by kind
    (bench.step_profile), ms per chunk, and its ten longest."""
    from .step_profile import by_kind, events_of, kernels_of

    kernels = kernels_of(events_of(prof, cuda))
    kinds = {kind: v["us"] / 1e3 / chunks for kind, v in by_kind({"kernels": kernels}).items()}
    return kinds, [{"name": k["name"][:100], "kind": k["kind"], "ms_per_chunk": k["us"] / 1e3 / chunks}
                   for k in kernels[:10]]


def full_batch(engine, job, chunks, names) -> dict:
    n = job.max_batch_size
    engine.drop_caches()
    for request in _requests(job, chunks, names, n, 10_000):  # warm-up of the same shapes
        engine.add_request(request)
    _drain(engine)
    requests = _requests(job, chunks, names, n, 20_000)
    prepared = [engine.prepare(r) for r in requests]
    vision = engine.model.vision
    forward = vision.forward

    spans: list[tuple] = []  # CUDA events around each vision call: the GPU time from its first to last kernel
    cuda = engine.device.type == "cuda"

    def annotated(items):
        if not cuda:
            return forward(items)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.profiler.record_function("vlora::vision"):
            out = forward(items)
        end.record()
        spans.append((start, end))
        return out

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    vision.forward = annotated
    try:
        if cuda:
            torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            for request, prep in zip(requests, prepared):
                engine.add_request(request, prep)
            steps = _drain(engine)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
    finally:
        vision.forward = forward
    if not cuda:  # no device timeline to split
        return {"chunks": n, "wall_s": wall, "chunks_per_s": n / wall, "steps": steps}
    busy = _kernel_ms(prof)
    kinds, top = kernel_kinds(prof, n)
    vision_ms = sum(a.elapsed_time(b) for a, b in spans)
    # host syncs per step, counted on a second batch (no profiler)
    for request in _requests(job, chunks, names, n, 30_000):
        engine.add_request(request)
    counted: list[int] = []
    syncs, sources = host_syncs(lambda: counted.append(_drain(engine)))
    return {"chunks": n, "wall_s": wall, "chunks_per_s": n / wall, "steps": steps,
            "gpu_busy_share": busy / (wall * 1e3), "gpu_ms_per_chunk": busy / n,
            "vision_span_ms_per_chunk": vision_ms / n, "rest_gpu_ms_per_chunk": (busy - vision_ms) / n,
            "host_syncs_per_step": syncs / max(1, counted[0]), "sync_sources": sources,
            "kinds_ms_per_chunk": kinds, "top_kernels": top}


def paced(engine, job, chunks, names, rate: float, seconds: float) -> dict:
    engine.drop_caches()
    count = int(rate * seconds)
    requests = _requests(job, chunks, names, count, 40_000 + int(rate) * 1000)
    arrivals = [i / rate for i in range(count)]
    sent, latencies, step_ms, widest = {}, [], [], 0
    t0, i = time.perf_counter(), 0
    while i < count or engine.has_unfinished():
        now = time.perf_counter() - t0
        while i < count and arrivals[i] <= now:
            rid = engine.add_request(requests[i])
            sent[rid] = t0 + arrivals[i]
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(arrivals[i] - now, 0.01)) if i < count else 0)
            continue
        start = time.perf_counter()
        outputs = engine.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
        widest = max(widest, len(engine.scheduler.running))
        for out in outputs:
            if out.finished and out.request_id in sent:
                latencies.append((time.perf_counter() - sent.pop(out.request_id)) * 1e3)
    wall = time.perf_counter() - t0
    return {"rate": rate, "sent": count, "served_per_s": len(latencies) / wall, "p50_ms": percentile(latencies, 50),
            "p95_ms": percentile(latencies, 95), "mean_step_ms": statistics.fmean(step_ms) if step_ms else 0.0,
            "steps": len(step_ms), "most_running": widest}


@contextmanager
def encode_ahead_set(engine, on: bool):
    """The engine's encode_ahead as `on` for a measurement, then as it was."""
    from .streams_served import set_encode_ahead

    before = set_encode_ahead(engine, on)
    try:
        yield
    finally:
        set_encode_ahead(engine, before)


def engine_only(engine, job, chunks, names, rates=(20.0, 30.0, 40.0), seconds: float = 6.0) -> dict:
    out = {"full_batch": full_batch(engine, job, chunks, names)}
    if engine.encode_ahead:  # the same batch with the next step's pictures encoded at their own step, alternated
        runs = []
        for ahead in (False, True, False, True):
            with encode_ahead_set(engine, ahead):
                runs.append(dict(full_batch(engine, job, chunks, names), encode_ahead=ahead))
        out["encode_ahead_ab"] = runs
    out["paced"] = [paced(engine, job, chunks, names, r, seconds) for r in rates]
    return out


def format_engine_only(result: dict) -> str:
    fb = result["full_batch"]
    if "gpu_busy_share" not in fb:
        lines = [f"engine in process, {fb['chunks']} chunks at once: {fb['chunks_per_s']:.1f} chunks/s"]
    else:
        lines = [f"engine in process, {fb['chunks']} chunks at once: {fb['chunks_per_s']:.1f} chunks/s in "
                 f"{fb['steps']} steps; GPU busy {fb['gpu_busy_share']:.0%}; GPU ms per chunk "
                 f"{fb['gpu_ms_per_chunk']:.1f} (vision calls' span {fb['vision_span_ms_per_chunk']:.1f}, rest "
                 f"{fb['rest_gpu_ms_per_chunk']:.1f}); host syncs per step {fb['host_syncs_per_step']:.1f} "
                 f"from {fb['sync_sources']}",
                 "  GPU ms per chunk by kernel kind: " + ", ".join(
                     f"{k} {v:.2f}" for k, v in sorted(fb["kinds_ms_per_chunk"].items(), key=lambda kv: -kv[1]))]
    for run in result.get("encode_ahead_ab", []):
        if "gpu_busy_share" in run:
            lines.append(f"  encode_ahead={run['encode_ahead']}: {run['chunks_per_s']:.1f} chunks/s, GPU busy "
                         f"{run['gpu_busy_share']:.0%}, GPU ms per chunk {run['gpu_ms_per_chunk']:.1f}")
    for p in result["paced"]:
        lines.append(f"  paced {p['rate']:.0f}/s: served {p['served_per_s']:.1f}/s, p50 {p['p50_ms']:.0f} ms, "
                     f"p95 {p['p95_ms']:.0f} ms, {p['steps']} steps of {p['mean_step_ms']:.1f} ms, "
                     f"at most {p['most_running']} running")
    return "\n".join(lines)


