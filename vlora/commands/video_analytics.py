"""`vlora video_analytics`: the configured camera streams against the server, with live progress
lines, a JSON-lines sink and a per-stream report (conf/video_analytics.yaml).

    VLORA_TOKEN=... vlora video_analytics                   # the server `vlora serve` started, 20 s
    vlora video_analytics server=own                        # an own in-process server
    VLORA_TOKEN=... vlora video_analytics server.port=18861 duration_s=60 run_name=rush_hour

Each run writes ${paths.results}/video_analytics/<run_name or start time>/; `latest` links the newest.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..config import to_dataclass
from .app_runs import abandon_run, finish_run, start_run
from .app_server import connect


@dataclass
class VideoJob:
    host: str
    port: int | None
    token: str | None
    manifest: str | list | None  # fusion manifest(s) and/or adapter directories (adapters.read_sources)
    heads: str
    load_adapters: bool
    duration_s: float | None
    report_every_s: float
    sink: str
    report: str
    streams: list
    teachers_dir: str | None = None  # where shadow teachers are cached, unless a shadow names its own dir
    datasets_dir: str | None = None  # domain datasets, for domains whose adapter records none (resolution check)


def job_from_cfg(cfg: DictConfig) -> VideoJob:
    values = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
              for k in ("manifest", "heads", "load_adapters", "duration_s", "report_every_s", "sink", "report",
                        "streams", "teachers_dir", "datasets_dir") if k in cfg}
    return to_dataclass(VideoJob, values, host=cfg.server.host, port=cfg.server.port, token=cfg.server.token)


def run_streams(job: VideoJob, port: int, out=None) -> dict[str, Any]:
    out = out or sys.stderr  # looked up per call: tests and callers swap sys.stderr
    from apps.video_analytics import JsonlSink, StreamManager, format_line, load_manifest, stream_from_dict
    from serve.rpc import Client

    streams = [stream_from_dict(_with_teachers_dir(s, job.teachers_dir)) for s in job.streams]
    manifest = load_manifest(job.manifest)
    if manifest is None:
        print(f"video_analytics: no fusion manifest at {job.manifest}; every task runs on the base model",
              file=out, flush=True)
    began = time.monotonic()
    with JsonlSink(job.sink) as sink:
        manager = StreamManager(lambda: Client(job.host, port, job.token), manifest, sink, job.heads,
                                job.load_adapters, job.datasets_dir)
        try:
            for s in streams:
                runner = manager.add(s)
                for line in runner.route_lines():  # where each task goes, its expected accuracy beside its baseline
                    print(f"video_analytics: route: {line}", file=out, flush=True)
                for line in runner.warnings:  # frame sizes unlike the distillation's: said before any answer
                    print(f"video_analytics: warning: {line}", file=out, flush=True)
            last = time.monotonic()
            while job.duration_s is None or time.monotonic() - began < job.duration_s:
                if manager.wait(timeout=0.2):
                    break
                if time.monotonic() - last >= job.report_every_s:
                    last = time.monotonic()
                    for snap in manager.snapshot().values():
                        print(format_line(snap), file=out, flush=True)
        finally:
            snapshots = manager.close()
    return {"duration_s": round(time.monotonic() - began, 3), "sink": job.sink, "streams": snapshots}


def _with_teachers_dir(stream: dict[str, Any], directory: str | None) -> dict[str, Any]:
    """The stream entry with `dir` set on its shadow settings (the stream's and its tasks') that lack one."""
    def fill(shadow):
        return {**shadow, "dir": directory} if isinstance(shadow, dict) and not shadow.get("dir") else shadow

    if not directory:
        return stream
    out = {**stream, "shadow": fill(stream.get("shadow"))}
    out["tasks"] = [{**t, "shadow": fill(t["shadow"])} if isinstance(t, dict) and "shadow" in t else t
                    for t in stream.get("tasks", [])]
    return out


def print_report(report: dict[str, Any]) -> None:
    print(f"{'stream':<10} {'task':<10} {'route':<22} {'chunks':>7} {'dropped':>7} {'p50 ms':>8} {'p95 ms':>8} "
          f"{'p99 ms':>8} {'accuracy':>8} {'agree':>6} {'n':>4}")
    teachers = set()
    for name, s in report["streams"].items():
        for task, t in s["tasks"].items():
            route = s["routes"][task]
            where = f"{route['adapter'] or 'base'}/{route['output_mode']}"
            lat = t["latency_ms"]
            acc = "-" if t["accuracy"] is None else f"{t['accuracy']:.3f}"
            shadow = t.get("shadow") or {}
            agree = "-" if shadow.get("agreement") is None else f"{shadow['agreement']:.3f}"
            if shadow:
                teachers.add(shadow["teacher"])
            print(f"{name:<10} {task:<10} {where:<22} {s['chunks_processed']:>7} {s['chunks_dropped']:>7} "
                  f"{lat['p50'] or '-':>8} {lat['p95'] or '-':>8} {lat['p99'] or '-':>8} {acc:>8} {agree:>6} "
                  f"{shadow.get('compared', '-'):>4}")
        if s["status"] == "failed" or s["last_error"]:
            print(f"{name:<10} status {s['status']}, reconnects {s['reconnects']}, last error: {s['last_error']}")
        for task, t in s["tasks"].items():
            if (t.get("shadow") or {}).get("last_error"):
                print(f"{name:<10} {task}: shadow teacher {t['shadow']['teacher']}: {t['shadow']['last_error']}")
    from apps.common.routing import route_worth

    for name, s in report["streams"].items():  # what each routed adapter is expected to score, beside its baseline
        for task, route in s["routes"].items():
            if route_worth(route):
                print(f"{name:<10} {task}: {route['adapter'] or route['selected']} {route_worth(route)}")
    print("accuracy: against ground truth (sources that carry it: synthetic); '-' where the source has none")
    print("agree: agreement with the shadow teacher " + (", ".join(sorted(teachers)) if teachers else "(none set)")
          + " over the n chunks it compared (a sampled share; '-' where it compared none)")


def run(cfg: DictConfig) -> dict[str, Any]:
    from apps.video_analytics import stream_from_dict

    try:  # streams are checked before anything connects or is built
        [stream_from_dict(s) for s in job_from_cfg(cfg).streams]
    except (ValueError, TypeError, KeyError) as e:
        raise SystemExit(f"video_analytics: streams: {e}") from None
    target = connect(cfg, "video_analytics")
    run_dir = start_run(cfg, "video_analytics")  # sets run_name: the paths below are this run's
    job = job_from_cfg(cfg)
    job.host, job.port, job.token = target.host, target.port, target.token
    server = None
    try:
        if target.own:  # imported here: a client of a running server loads no model code (transformers, torch)
            from .serve import start_server

            server = start_server(cfg, job.token, len(job.streams) + 4, sources=job.manifest)  # serves what routing reads
            job.port = server.port
        print(f"video_analytics: {len(job.streams)} streams against {job.host}:{job.port}"
              + (" (own server)" if server else ""), file=sys.stderr, flush=True)
        try:
            report = run_streams(job, job.port)
        finally:
            if server is not None:
                server.close()
        report["server"] = {"host": job.host, "port": job.port, "own": server is not None, "pid": target.pid}
        Path(job.report).parent.mkdir(parents=True, exist_ok=True)
        Path(job.report).write_text(json.dumps(report, indent=1))
    except BaseException:
        abandon_run(run_dir)
        raise
    latest = finish_run(cfg.results_dir, run_dir)
    print_report(report)
    print(f"results: {job.sink}; report: {job.report}" + (f"; newest run: {latest}" if latest else ""))
    return report
