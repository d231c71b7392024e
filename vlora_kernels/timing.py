"""Timing on the GPU: CUDA events around graph replays, medians, and the device's two ceilings.

Every benchmark in `vlora_kernels/` times through `time_op`, so all numbers are taken the same way:
warm-up first (compilation and autotuning stay out), then many timed runs, median reported.
`time_op_tails` takes the same runs and reports their 50th, 90th and 99th percentiles as well.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def time_op(fn: Callable[[], object], warmup: int = 10, repeats: int = 50, use_graph: bool = True,
            inner: int = 20) -> float:
    """Median microseconds of one call of `fn` on the current CUDA device.

    With `use_graph`, up to `inner` calls are captured in one CUDA graph and each replay is
    timed with events, which removes the host launch gaps that would dominate microsecond-scale
    kernels. Calls slower than half a millisecond are timed one by one without a graph: launch
    gaps no longer matter there, and a graph of many large calls would only hold memory.
    """
    return statistics.median(_run_times_us(fn, warmup, repeats, use_graph, inner))


def time_op_tails(fn: Callable[[], object], warmup: int = 10, repeats: int = 50, use_graph: bool = True,
                  inner: int = 20) -> dict[str, float]:
    """`time_op`'s median as `us`, with the p50, p90 and p99 of the same timed runs (`latency_stats`).

    With a graph, a run is the mean call of one replay of up to `inner` calls, so the tails show
    the spread from replay to replay (clocks, memory, other work on the device), not within one;
    slow calls are timed alone. The p99 of fewer than about 100 repeats is close to the slowest run.
    """
    return latency_stats(_run_times_us(fn, warmup, repeats, use_graph, inner))


def latency_stats(samples_us: list[float]) -> dict[str, float]:
    """us (the median) and p50_us, p90_us, p99_us, linearly interpolated between the sorted samples."""
    if not samples_us:
        raise ValueError("latency_stats needs at least one sample")
    ordered = sorted(samples_us)

    def percentile(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return dict(us=statistics.median(ordered), p50_us=percentile(0.5), p90_us=percentile(0.9),
                p99_us=percentile(0.99))


def _run_times_us(fn: Callable[[], object], warmup: int, repeats: int, use_graph: bool, inner: int) -> list[float]:
    """Microseconds per call of each of `repeats` timed runs (see `time_op`)."""
    if not torch.cuda.is_available():
        raise RuntimeError("time_op needs a CUDA device")
    for _ in range(max(1, warmup)):
        fn()
    single = _event_time_us(fn)
    runner, per_run = fn, 1
    if use_graph and single < 500:
        inner = max(1, min(inner, int(2000 / max(single, 1.0))))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm the capture stream first: its allocator pool, and any per-stream state an op keeps
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(inner):
                fn()
        runner, per_run = graph.replay, inner
        runner()
    torch.cuda.synchronize()
    return [_event_time_us(runner) / per_run for _ in range(repeats)]


# GPU cycles of busy work queued ahead of each timed run (about 1 ms at Hopper clocks). The run is
# enqueued while the GPU is still on it, so a host stall of up to that long between the start
# event and the run's launch is not timed. Without it, runs on an H100 now and then read
# 250-330 us for a 5-10 us op, a whole measurement at a time; the cause was not found, and a
# host stall is one that would read so.
HOST_SLACK_CYCLES = 2_000_000


def _event_time_us(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(HOST_SLACK_CYCLES)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def host_syncs(fn: Callable[[], object], where: tuple[str, ...] = ("/serve/", "/bench/")) -> tuple[int, dict[str, int]]:
    """Host syncs while fn runs (torch's sync debug mode), and the innermost frames of the caller's
    code (paths holding one of `where`) they come from: the eight most frequent, with counts."""
    import traceback
    import warnings

    sources: dict[str, int] = {}
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if any(w in f.filename for w in where)]
        place = f"{ours[-1].filename.rsplit('/', 2)[-1]}:{ours[-1].lineno} {ours[-1].name}" if ours else "?"
        sources[place] = sources.get(place, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    return sum(sources.values()), dict(sorted(sources.items(), key=lambda kv: -kv[1])[:8])


def copy_bandwidth_gbs(n_bytes: int = 2 << 30) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(n_bytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = time_op(lambda: dst.copy_(src), warmup=3, repeats=20, use_graph=False)
    return 2 * src.numel() * src.element_size() / (us * 1e-6) / 1e9


def matmul_tflops(n: int = 8192, dtype: torch.dtype = torch.float16) -> float:
    """Dense matrix-product rate of the device's library GEMM, in TFLOP/s."""
    a = torch.randn(n, n, dtype=dtype, device="cuda")
    b = torch.randn(n, n, dtype=dtype, device="cuda")
    us = time_op(lambda: a @ b, warmup=3, repeats=20, use_graph=False)
    return 2 * n**3 / (us * 1e-6) / 1e12


def sustained_matmul_tflops(n: int = 8192, dtype: torch.dtype = torch.bfloat16, seconds: float = 20.0) -> dict:
    """The same product's rate once the device has run it back to back for `seconds`: {"tflops": the median
    rate of the last quarter's batches, "first_tflops": the first batch's, "batches", "sm_clock_mhz": the SM
    clock at the end where NVML answers, else None}.

    Why: a GPU at its power limit lowers its clocks within seconds of full load (an H200 at 700 W ran its SMs
    at 1.5-1.75 GHz under camera streams, against 1.98 GHz idle: results/streams/nvidia_h200/window/dmon.txt), so
    a sustained workload meets this rate, not `matmul_tflops`'s burst of 20 products."""
    import time

    a = torch.randn(n, n, dtype=dtype, device="cuda")
    b = torch.randn(n, n, dtype=dtype, device="cuda")
    out = torch.empty(n, n, dtype=dtype, device="cuda")
    torch.mm(a, b, out=out)
    torch.cuda.synchronize()
    per_batch = max(1, int(0.25 / (time_op(lambda: torch.mm(a, b, out=out), warmup=2, repeats=5, use_graph=False)
                                   * 1e-6)))  # about a quarter second a batch
    rates, end = [], time.monotonic() + seconds
    while time.monotonic() < end or len(rates) < 4:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per_batch):
            torch.mm(a, b, out=out)
        stop.record()
        stop.synchronize()
        rates.append(2 * n**3 * per_batch / (start.elapsed_time(stop) * 1e-3) / 1e12)
    try:
        clock = torch.cuda.clock_rate()
    except Exception:  # no NVML on this machine: the rate alone
        clock = None
    return {"tflops": statistics.median(rates[-max(1, len(rates) // 4):]), "first_tflops": rates[0],
            "batches": len(rates), "sm_clock_mhz": clock}


def roofline_us(flops: float, n_bytes: float, tflops: float, gbs: float) -> float:
    """The floor of an op: the larger of its arithmetic time and its memory time, in microseconds."""
    return max(flops / (tflops * 1e12), n_bytes / (gbs * 1e9)) * 1e6
