"""Unmerge-only's capacity for the serving evaluation's load sweep, and the order the policies
replay each (point, seed) in."""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from pathlib import Path

from bench.serving_replay import build_requests, replay, use_policy
from bench.serving_stats import capacity_rps
from serve.orchestrator import WorkloadSpec, generate
from .results import write_json


def _served_rps(engine, job, names: list[str], spec: WorkloadSpec) -> tuple[float, dict, dict]:
    """Unmerge-only serving `spec`: (requests/s read off the middle 80% of the finishes, metrics, extra)."""
    trace = generate(spec)
    requests = build_requests(trace, names, job.image_size, spec.seed, sum(job.text_tokens) // 2, job.video_frames[1])
    use_policy(engine, "unmerge_only", {})
    records: dict = {}
    m, extra = replay(engine, trace, requests, job.drain_s + 120.0, job.prepare_threads, records_out=records)
    finish = [r.finish_ms for r in records.values() if r.finish_ms is not None]
    return capacity_rps(finish), m, extra


def measure_capacity(engine, job, names: list[str], out: Path) -> dict:
    """Unmerge-only's capacity (requests/s) at the job's middle skewness, written to capacity.json.
    First a burst (every request within the first 0.1 s); with capacity_arrival="poisson" then
    Poisson arrivals, as the workload's, at capacity_overload x the burst's rate for
    capacity_probe_s: the queue builds up and the served rate is the capacity under that arrival
    process. A probe served about as fast as requests came (>= 95%) was not overloaded: the rate it
    was offered is a lower bound, and the larger of that and the burst's estimate is kept."""
    spec = job.workload()
    burst = dataclasses.replace(spec, rate=job.capacity_requests / 0.1, duration_s=0.1, seed=job.seed + 7 * 10**5)
    burst_rps, m, extra = _served_rps(engine, job, names, burst)
    cap = dict(capacity_rps=burst_rps, burst_rps=burst_rps, requests=m["requests"], completed=m["completed"],
               skewness=burst.skewness, policy="unmerge_only", span_s=extra["replay_s"], arrival="burst",
               date=time.strftime("%Y-%m-%d"))
    print(f"capacity: unmerge-only serves {burst_rps:.2f} requests/s ({m['requests']}-request burst, "
          f"{m['completed']} done in {extra['replay_s']:.1f} s)", file=sys.stderr, flush=True)
    if job.capacity_arrival == "poisson":
        rate = job.capacity_overload * burst_rps
        probe = dataclasses.replace(spec, rate=rate, duration_s=job.capacity_probe_s, arrival="poisson",
                                    seed=job.seed + 8 * 10**5)
        served, m, extra = _served_rps(engine, job, names, probe)
        overloaded = served < 0.95 * rate
        # a probe that kept up shows only that capacity is at least the offered rate: its finishes over a
        # few seconds can come faster than the arrivals (an H200 probe offered 14.6/s "served" 20.5/s)
        bound = min(served, rate)
        cap.update(capacity_rps=served if overloaded else max(bound, burst_rps), poisson_rps=served,
                   probe_rate=rate, probe_requests=m["requests"], probe_completed=m["completed"],
                   arrival="poisson", lower_bound=not overloaded)
        print(f"capacity: Poisson arrivals at {rate:.2f} requests/s: served {served:.2f} requests/s"
              f"{'' if overloaded else ' (not overloaded: a lower bound)'}", file=sys.stderr, flush=True)
    write_json(out / "capacity.json", cap)
    return cap


def run_order(names: list[str], sweep: str, x: float, skewness: float, seed: int, shuffle: bool) -> list[str]:
    """The order the policies replay a (point, seed) in: shuffled by a generator seeded with the
    point and the seed (a rerun replays in the same order), so that no policy always runs first
    (a cold cache, a GPU's clocks and thermals drifting over a point) or right after another."""
    order = list(names)
    if shuffle:
        random.Random(f"{sweep}/{x:g}/{skewness:g}/{seed}").shuffle(order)
    return order
