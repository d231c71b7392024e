"""Per-stream live metrics: frames in, chunks processed, drops, latency percentiles, accuracy.

Latency of a chunk is wall time from the moment its last frame was read (the chunk is ready)
to the moment the last of its tasks' results arrived: it includes the time the chunk waited in
the stream's own queue, which is what a viewer of the live feed experiences. Accuracy is kept
per task, over the chunks whose source has ground truth: the fraction answered exactly (counts,
labels) or, for detection, F1 of boxes at IoU >= 0.5 summed over the chunks.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from apps.common.answers import f1
from apps.common.stats import percentiles

WINDOW = 4096  # latencies kept per series; percentiles describe the latest WINDOW chunks


@dataclass
class TaskMetrics:
    requests: int = 0
    errors: int = 0
    unparsed: int = 0  # answers that held no count / label / box
    slo_violations: int = 0
    head_answers: int = 0
    scored: int = 0
    correct: int = 0
    abs_error: float = 0.0
    tp: int = 0
    fp: int = 0
    fn: int = 0
    mode_switches: int = 0
    latency_ms: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    server_ms: deque = field(default_factory=lambda: deque(maxlen=WINDOW))

    def accuracy(self, detect: bool) -> float | None:
        if not self.scored:
            return None
        return round(f1(self.tp, self.fp, self.fn) if detect else self.correct / self.scored, 4)


class StreamMetrics:
    """Thread-safe counters of one stream; `snapshot()` is a JSON-ready dict."""

    def __init__(self, name: str, tasks: list[str], detect_tasks: set[str] = frozenset()):
        self.name = name
        self.lock = threading.Lock()
        self.started = time.perf_counter()
        self.frames_in = 0
        self.frames_sampled = 0
        self.frames_lost = 0  # partial chunks given up at a reconnect
        self.chunks_made = 0
        self.chunks_processed = 0
        self.chunks_failed = 0
        self.reconnects = 0
        self.source_errors = 0
        self.status = "starting"
        self.last_error: str | None = None
        self.tasks = {t: TaskMetrics() for t in tasks}
        self.detect_tasks = set(detect_tasks)
        self.latency_ms: deque = deque(maxlen=WINDOW)
        self.queue_ms: deque = deque(maxlen=WINDOW)  # time chunks waited in the stream's queue
        self.processed_indices: deque = deque(maxlen=WINDOW)

    def add(self, **counts: int) -> None:
        with self.lock:
            for key, n in counts.items():
                setattr(self, key, getattr(self, key) + n)

    def set_status(self, status: str, error: str | None = None) -> None:
        with self.lock:
            self.status = status
            if error is not None:
                self.last_error = error

    def task_result(self, task: str, latency_ms: float, server_ms: float | None, score: dict[str, Any] | None,
                    parsed: bool, head: bool, slo_ms: float | None) -> None:
        with self.lock:
            m = self.tasks[task]
            m.requests += 1
            m.latency_ms.append(latency_ms)
            if server_ms is not None:
                m.server_ms.append(server_ms)
            m.unparsed += not parsed
            m.head_answers += head
            m.slo_violations += slo_ms is not None and latency_ms > slo_ms
            if score is not None:
                m.scored += 1
                m.correct += bool(score.get("correct"))
                m.abs_error += score.get("abs_error", 0.0)
                m.tp, m.fp, m.fn = m.tp + score.get("tp", 0), m.fp + score.get("fp", 0), m.fn + score.get("fn", 0)

    def task_error(self, task: str, error: str) -> None:
        with self.lock:
            self.tasks[task].errors += 1
            self.last_error = error

    def mode_switch(self, task: str) -> None:
        with self.lock:
            self.tasks[task].mode_switches += 1

    def chunk_done(self, index: int, latency_ms: float, queue_ms: float, ok: bool) -> None:
        with self.lock:
            if ok:
                self.chunks_processed += 1
                self.latency_ms.append(latency_ms)
                self.queue_ms.append(queue_ms)
                self.processed_indices.append(index)
            else:
                self.chunks_failed += 1

    def snapshot(self, queue_stats: dict[str, int] | None = None) -> dict[str, Any]:
        with self.lock:
            elapsed = time.perf_counter() - self.started
            tasks = {}
            for name, m in self.tasks.items():
                tasks[name] = {"requests": m.requests, "errors": m.errors, "unparsed": m.unparsed,
                               "head_answers": m.head_answers, "slo_violations": m.slo_violations,
                               "mode_switches": m.mode_switches, "scored": m.scored,
                               "accuracy": m.accuracy(name in self.detect_tasks),
                               "latency_ms": percentiles(m.latency_ms), "server_ms": percentiles(m.server_ms)}
                if name in self.detect_tasks:
                    tasks[name].update(tp=m.tp, fp=m.fp, fn=m.fn)
                elif m.scored and m.abs_error:
                    tasks[name]["mean_abs_error"] = round(m.abs_error / m.scored, 4)
            dropped = (queue_stats or {}).get("dropped", 0)
            return {"stream": self.name, "status": self.status, "elapsed_s": round(elapsed, 3),
                    "frames_in": self.frames_in, "frames_sampled": self.frames_sampled, "frames_lost": self.frames_lost,
                    "chunks_made": self.chunks_made, "chunks_processed": self.chunks_processed,
                    "chunks_failed": self.chunks_failed, "chunks_dropped": dropped,
                    "chunks_per_s": round(self.chunks_processed / elapsed, 3) if elapsed > 0 else 0.0,
                    "reconnects": self.reconnects, "source_errors": self.source_errors, "last_error": self.last_error,
                    "latency_ms": percentiles(self.latency_ms), "queue_ms": percentiles(self.queue_ms),
                    "queue": dict(queue_stats or {}), "tasks": tasks}


def format_line(snap: dict[str, Any]) -> str:
    """One progress line of a stream's snapshot."""
    lat = snap["latency_ms"]
    accs = " ".join(f"{name}={t['accuracy']:.2f}" for name, t in snap["tasks"].items() if t["accuracy"] is not None)
    # agreement with the shadow teacher / chunks compared
    agree = " ".join(f"{name}={'-' if s['agreement'] is None else format(s['agreement'], '.2f')}/{s['compared']}"
                     for name, s in ((n, t.get("shadow")) for n, t in snap["tasks"].items()) if s is not None)
    return (f"{snap['stream']:<10} {snap['status']:<12} frames {snap['frames_in']:>5}  chunks "
            f"{snap['chunks_processed']}/{snap['chunks_made']}  dropped {snap['chunks_dropped']}  "
            f"p50 {lat['p50']} ms  p95 {lat['p95']} ms" + (f"  acc {accs}" if accs else "")
            + (f"  agree {agree}" if agree else ""))
