"""One point of the scaling suite's streams workload, on one engine or on replicas, and its kill variant.

`run_scaling_point` is bench.streams_load.run_point for any engine the RPyC front end drives: the
cameras (a spawned process, stream i's chunk k sent at `t0 + i / N + k` whether or not earlier ones
are answered) against a fresh RpcServer on loopback around either the engine itself or a
`ReplicatedEngine` over Ray Serve replicas, as `vlora serve replicas.count=N` fronts them. Its row is
made by the same `_row`; a replicas point adds what the front end saw of the replicas: chunks
answered per replica, chunks sent again (retried) or failed, and each replica's adapter loads
(adapter affinity: each adapter loaded by few replicas, once each).

With `kill` (a function that kills one replica's process and returns its id, the time of the kill
and the requests it held), it is called `kill_after_s` after the cameras start and the cameras keep running: the point
then also reports chunks lost (sent and never answered, or answered with an error: must be 0), the
p95 latency per second of send time around the kill, the spike (the highest such p95 from the
second before the kill on) and the recovery time: from the kill to the first second from which
every later second's p95 is within the target.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import threading
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np

from apps.common.stats import percentile

from .streams_load import _cameras, _log, _row, _settle, gc_pauses, run_cameras


def run_scaling_point(engine, job, n: int, chunks: list[np.ndarray], adapters: list[str],
                      seconds: float | None = None, kill=None) -> dict:
    """n head-mode streams for `seconds` (warm-up, unmeasured), job.seconds (a search point) or
    job.kill_seconds (kill given); returns the point's row."""
    from serve.rpc import Limits, RpcServer

    warm_up = seconds is not None
    first = 0 if warm_up else math.ceil(job.warmup_s)
    measured = math.ceil(seconds if warm_up else job.kill_seconds if kill else job.seconds)
    abort_all = getattr(engine, "abort_all", None)  # replicas: nothing stays behind a settled point
    leftover = abort_all() if abort_all else 0
    before = engine.stats()
    before = before if hasattr(before, "by_replica") else None  # replicas: the front end's counts per replica
    token = secrets.token_hex(16)
    server = RpcServer(engine, token, "127.0.0.1", 0, Limits(), max_connections=n + 8).start()
    label = "warm-up " if warm_up else "kill " if kill else ""
    _log(f"{label}scaling streams={n}: {first + measured} chunks each")
    killed = {}
    timer = None
    if kill is not None:
        def fire():
            try:  # the time is perf_counter's, CLOCK_MONOTONIC: the camera process's clock too
                killed["replica"], killed["t"], killed["held"] = kill()
            except Exception as e:  # reported in the row, not lost in the timer's thread
                killed["error"] = f"{type(e).__name__}: {e}"
        timer = threading.Timer(job.kill_after_s, fire)
        timer.start()
    plain = SimpleNamespace(**dataclasses.asdict(job))  # the camera process needs no torch to read it
    if kill is not None:  # chunks a dead replica held are answered late, not abandoned at the usual drain
        plain.drain_s = job.kill_drain_s
    try:
        with gc_pauses() as pauses:
            records, errors, t0 = run_cameras(_cameras, (plain, "head", n, server.port, token, chunks, adapters, first,
                                                         first + measured), first + measured + plain.drain_s + 120)
    finally:
        if timer is not None:
            timer.cancel()
    settled = _settle(server)
    server.close()
    errors = Counter(errors)
    row = _row(job, "head", n, records, errors, t0 + first, measured)
    row.update(point="warm-up" if warm_up else "kill" if kill else "warm", settled=settled,
               leftover_before=leftover, gc=pauses.summary())
    if before is not None:
        row.update(replica_counts(before, engine.stats()))
    if kill is not None:
        row.update(kill_report(records, errors, killed, job.target_ms))
    _log(label + " ".join(f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}"
                          for k in SHOWN if k in row))
    return row


SHOWN = ("streams", "done", "unfinished", "errors", "p50_ms", "p95_ms", "chunks_per_s", "lost", "spike_p95_ms",
         "recovery_s", "retried", "chunks_by_replica", "adapter_loads")


def replica_counts(before, after) -> dict:
    """The point's share of the front end's replica counters (ReplicatedStats before and after):
    chunks answered per replica, retried and failed, and adapter loads per replica so far (loads
    happen once per adapter and replica, mostly in the first point)."""
    by = {r: n - before.by_replica.get(r, 0) for r, n in after.by_replica.items()}
    return {"chunks_by_replica": {r: n for r, n in by.items() if n}, "retried": after.retried - before.retried,
            "failed": after.failed - before.failed, "adapter_loads": after.adapter_loads,
            "replicas_per_adapter": replicas_per_adapter(after.adapter_loads)}


def replicas_per_adapter(loads: dict[str, dict[str, int]]) -> dict[str, int]:
    """adapter -> how many replicas have loaded it (1: perfect affinity)."""
    out: Counter[str] = Counter()
    for per_adapter in loads.values():
        out.update(name for name, k in per_adapter.items() if k)
    return dict(sorted(out.items()))


def kill_report(records: list[dict], errors: Counter, killed: dict, target_ms: float) -> dict:
    """Chunks lost, the per-second p95 timeline (by send time, second 0 starting at the kill;
    unanswered chunks count at the time waited), the spike and the recovery time."""
    lost = sum(not r["finished"] for r in records) + sum(errors.values())
    if "t" not in killed or "error" in killed:
        return {"lost": lost, "killed": None, "kill_error": killed.get("error", "the kill never fired"),
                "timeline": [], "spike_p95_ms": math.nan, "recovery_s": math.nan, "recovered": False}
    t_kill = killed["t"]
    seconds: dict[int, list[float]] = {}
    for r in records:
        seconds.setdefault(math.floor(r["sent"] - t_kill), []).append(r["latency_ms"])
    timeline = [{"second": s, "chunks": len(v), "p95_ms": percentile(v, 95), "max_ms": max(v)}
                for s, v in sorted(seconds.items())]
    after = [t for t in timeline if t["second"] >= -1]  # chunks in flight on the victim were sent just before
    bad = [t["second"] for t in timeline if t["second"] >= 0 and t["p95_ms"] > target_ms]
    last = max((t["second"] for t in timeline), default=-1)
    recovered = not bad or bad[-1] < last
    return {"lost": lost, "killed": killed["replica"], "victim_held": killed.get("held"),
            "kill_at_s": t_kill - min(r["sent"] for r in records),
            "timeline": timeline, "spike_p95_ms": max((t["p95_ms"] for t in after), default=math.nan),
            "p95_before_ms": percentile([v for s, vs in seconds.items() if s < -1 for v in vs], 95)
            if any(s < -1 for s in seconds) else math.nan,
            "recovery_s": float(bad[-1] + 1 if bad else 0) if recovered else math.nan, "recovered": recovered}
