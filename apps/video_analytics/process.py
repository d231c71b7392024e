"""One chunk through the server: submit every task, poll them side by side, degrade a refused
route and retry, then score, record and draw the answers (the worker half of a StreamRunner)."""

from __future__ import annotations

import time
from typing import Any

from serve.rpc import ServerError

from apps.common.annotate import Annotator
from .chunker import Chunk
from .tasks import TaskSpec

# Server refusals that a simpler route may not hit (a head or adapter the server lacks).
REFUSALS = ("rejected", "unsupported", "bad_argument")


def _refused(runner, spec: TaskSpec, error: ServerError) -> bool:
    """Degrade the task's route after a refusal; True when there is a route left to try."""
    if error.kind not in REFUSALS:
        return False
    route = runner.routes[spec.label].degrade(error.message)
    if route is None:
        return False
    runner.routes[spec.label] = route
    runner.metrics.mode_switch(spec.label)
    runner.event("mode_switch", task=spec.label, route=route.to_dict())
    return True


def _collect(runner, chunk: Chunk, frames) -> dict[str, tuple[dict | None, float, str | None]]:
    """label -> (final event or None, arrival time, error) for every task of the chunk."""
    specs = {t.label: t for t in runner.config.tasks}
    out: dict[str, tuple[dict | None, float, str | None]] = {}
    pending: dict[str, Any] = {}

    def start(spec: TaskSpec) -> None:
        while True:
            try:
                pending[spec.label] = runner.submit(spec, frames, chunk)
                return
            except ServerError as e:
                if not _refused(runner, spec, e):
                    out[spec.label] = (None, time.perf_counter(), str(e))
                    return
            except Exception as e:  # the connection is gone and did not come back
                out[spec.label] = (None, time.perf_counter(), f"{type(e).__name__}: {e}")
                return

    for spec in runner.config.tasks:
        start(spec)
    deadline = time.monotonic() + runner.config.request_timeout_s
    while pending:
        wait = 0.25 if len(pending) == 1 else 0.02
        for label, stream in list(pending.items()):
            try:
                stream.poll(wait)
            except ServerError as e:
                del pending[label]
                if _refused(runner, specs[label], e):
                    start(specs[label])
                else:
                    out[label] = (None, time.perf_counter(), str(e))
                continue
            except Exception as e:
                del pending[label]
                out[label] = (None, time.perf_counter(), f"{type(e).__name__}: {e}")
                continue
            if stream.final is not None:
                del pending[label]
                out[label] = (stream.final, time.perf_counter(), None)
        if pending and time.monotonic() > deadline:
            for label, stream in pending.items():
                try:
                    stream.abort()
                except Exception:  # best effort: the request may have finished meanwhile
                    pass
                out[label] = (None, time.perf_counter(), f"no answer within {runner.config.request_timeout_s} s")
            pending.clear()
    return out


def _truth_value(spec: TaskSpec, chunk: Chunk, width: int, height: int):
    return None if chunk.truth is None else spec.truth(chunk.truth, width, height)


def run_chunk(runner, chunk: Chunk) -> None:
    cfg, m = runner.config, runner.metrics
    taken = time.perf_counter()
    width, height = chunk.size
    frames = chunk.rgb()
    results = _collect(runner, chunk, frames)
    latencies, lines, boxes, truth_boxes = [], [f"{cfg.name} #{chunk.index}"], [], []
    shadowed = chunk.shadowed  # tossed by the reader (StreamRunner._offer)
    served = []  # (task, served answer) for the shadow teacher
    for spec in cfg.tasks:
        final, arrived, error = results[spec.label]
        route = runner.routes[spec.label]
        record = {"type": "result", "stream": cfg.name, "chunk": chunk.index, "task": spec.label,
                  "t_start": round(chunk.t_start, 4), "t_end": round(chunk.t_end, 4), "frames": len(chunk.frames),
                  "route": {"adapter": route.adapter, "output_mode": route.output_mode}}
        if final is None:
            m.task_error(spec.label, error)
            record["error"] = error
            runner.record(record)
            lines.append(f"{spec.label}: error")
            continue
        if route.output_mode == "head" and final.get("head") is None:
            _refused(runner, spec, ServerError("rejected", "the server answered a head request without a head"))
        latency = (arrived - chunk.ready) * 1e3
        latencies.append(latency)
        pred = spec.predict(final, width, height, route.labels)  # text read against the domain's labels
        truth = _truth_value(spec, chunk, width, height)
        score = None if truth is None else spec.score(pred, truth)
        server_ms = (final.get("timing") or {}).get("total_ms")
        m.task_result(spec.label, latency, server_ms, score, pred.parsed, pred.source == "head", spec.latency_ms)
        record.update(prediction=pred.to_dict(), truth=truth, score=score, latency_ms=round(latency, 2),
                      server_ms=server_ms, finish_reason=final.get("finish_reason"))
        runner.record(record)
        if spec.label in shadowed:
            served.append((spec, pred))
        shown = len(pred.boxes) if spec.task == "detect" else "?" if pred.value() is None else pred.value()
        wanted = len(truth) if spec.task == "detect" and truth is not None else truth
        lines.append(f"{spec.label} {shown}" + ("" if truth is None else f"/{wanted}"))
        if spec.task == "detect":
            boxes += pred.boxes
            truth_boxes += truth or []
    if served:  # handed over without waiting; the teacher answers on its own thread, on the source's frames
        runner.shadow.offer(chunk.index, chunk.source_rgb(), served, (width, height))
    ok = len(latencies) == len(cfg.tasks)
    m.chunk_done(chunk.index, max(latencies) if latencies else 0.0, (taken - chunk.ready) * 1e3, ok)
    if cfg.annotate:
        if runner.annotator is None:
            runner.annotator = Annotator(cfg.annotate, runner.sample_rate or 30.0)
        if latencies:
            lines[0] += f" {max(latencies):.0f} ms"
        runner.annotator.write(chunk.frames, lines, boxes, truth_boxes if cfg.draw_truth else ())
