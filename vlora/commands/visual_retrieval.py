"""`vlora visual_retrieval`: queries over an image collection against the server, in batch mode
(a query file, or queries with known answers made from a world's truth) or interactively
(conf/visual_retrieval.yaml).

    vlora world && vlora visual_retrieval                   # world queries; the server `vlora serve`
                                                            # started (VLORA_TOKEN), else an own one
    vlora visual_retrieval queries=/data/q.jsonl collection=/data/images server=own
    vlora visual_retrieval queries=null                     # "<image> <question>" lines on stdin

Each run writes ${paths.results}/visual_retrieval/<run_name or start time>/; `latest` links the newest.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..config import to_dataclass
from .app_runs import abandon_run, finish_run, start_run
from .app_server import connect


@dataclass
class RetrievalJob:
    host: str
    port: int | None
    token: str | None
    manifest: str | list | None  # fusion manifest(s) and/or adapter directories (adapters.read_sources)
    collection: str
    queries: str | None
    queries_per_image: int
    max_new_tokens: int
    accuracy_target: float
    heads: str
    load_adapters: bool
    concurrency: int
    draw: str
    out_dir: str
    seed: int = 0
    routes: dict = field(default_factory=dict)
    max_frame_pixels: int = 3840 * 2160
    grounding: str = "qwen2_vl"


def grounding_of(value: str, arch: str | None) -> str:
    """`grounding: auto` follows the configured model's arch: Qwen2.5-VL writes native boxes in
    pixels of its resized input, every other model is read on Qwen2-VL's 0-1000 grid."""
    if value != "auto":
        return value
    return "qwen2_5_vl" if arch == "qwen2_5_vl" else "qwen2_vl"


def job_from_cfg(cfg: DictConfig) -> RetrievalJob:
    keys = ("manifest", "collection", "queries", "queries_per_image", "max_new_tokens", "accuracy_target", "heads",
            "load_adapters", "concurrency", "draw", "out_dir", "seed", "routes", "max_frame_pixels")
    values = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k] for k in keys}
    values["grounding"] = grounding_of(cfg.grounding, cfg.model.get("arch"))
    return to_dataclass(RetrievalJob, values, host=cfg.server.host, port=cfg.server.port, token=cfg.server.token)


def run_queries(job: RetrievalJob, port: int, stdin=None, stdout=None) -> dict[str, Any]:
    from apps.video_analytics import load_manifest
    from apps.visual_retrieval import ImageCollection, RetrievalApp, RetrievalConfig, read_queries, world_queries, \
        write_queries
    from serve.rpc import Client

    if not Path(job.collection).is_dir():
        raise SystemExit(f"visual_retrieval: no image collection at {job.collection} "
                         "(`vlora world` writes the default one)")
    collection = ImageCollection(job.collection)
    manifest = load_manifest(job.manifest)
    config = RetrievalConfig(max_new_tokens=job.max_new_tokens, routes=job.routes, accuracy_target=job.accuracy_target,
                             heads=job.heads, load_adapters=job.load_adapters, concurrency=job.concurrency,
                             draw=job.draw, max_frame_pixels=job.max_frame_pixels, grounding=job.grounding)
    out = Path(job.out_dir)
    with Client(job.host, port, job.token) as client:
        app = RetrievalApp(client, collection, config, manifest, out)
        if job.queries is None:
            answered = app.interactive(stdin or sys.stdin, stdout or sys.stdout)
            return {"mode": "interactive", "answered": answered}
        skipped: list[dict[str, Any]] = []  # a query file's malformed lines: left out and reported
        if job.queries == "world":
            if not collection.has_truth:
                raise SystemExit(f"visual_retrieval: queries=world needs a world's images; {job.collection} has no "
                                 "world truth (give queries=<file.jsonl>)")
            queries = world_queries(collection, job.queries_per_image, job.seed)
            write_queries(queries, out / "queries.jsonl")
        else:
            queries = read_queries(job.queries, skipped)
            for s in skipped:
                print(f"visual_retrieval: skipped {job.queries} {s['error']}", file=sys.stderr, flush=True)
        print(f"visual_retrieval: {len(queries)} queries over {len(collection)} images", file=sys.stderr, flush=True)
        report = app.run_batch(queries, out / "results.jsonl", skipped)
    report.update(mode="batch", manifest=job.manifest if manifest is not None else None)
    return report


def print_report(report: dict[str, Any]) -> None:
    from apps.common.routing import route_cell, route_worth
    from apps.visual_retrieval import route_kind

    print(f"{'kind':<10} {'route':<22} {'queries':>7} {'errors':>6} {'accuracy':>8} {'p50 ms':>8} {'p95 ms':>8} "
          f"{'p99 ms':>8}")
    rows = {**report["by_kind"], "all": report["overall"]}
    for kind, s in rows.items():
        # a kind routed per question (its heads each answer one question) has several routes
        routes = [r for name, r in report["routes"].items() if route_kind(name) == kind]
        where = ",".join(sorted({route_cell(r) for r in routes}))  # where, and why when a question chose it
        acc = "-" if s["accuracy"] is None else f"{s['accuracy']:.3f}"
        lat = s["latency_ms"]
        print(f"{kind:<10} {where:<22} {s['queries']:>7} {s['errors']:>6} {acc:>8} {lat['p50'] or '-':>8} "
              f"{lat['p95'] or '-':>8} {lat['p99'] or '-':>8}")
    for name, r in report["routes"].items():  # what each routed adapter is expected to score, beside its baseline
        if route_worth(r):
            print(f"route {name}: {r['adapter'] or r['selected']} {route_worth(r)}")
    overall = report["overall"]
    if overall.get("input_errors"):
        print(f"{overall['input_errors']} input error(s): images missing, truncated or corrupt (not sent)")
    for s in report.get("skipped", []):
        print(f"skipped query line {s['line']}: {s['error']}")


def run(cfg: DictConfig, stdin=None, stdout=None) -> dict[str, Any]:
    job = job_from_cfg(cfg)
    if not Path(job.collection).is_dir():  # checked before anything connects or is built
        raise SystemExit(f"visual_retrieval: no image collection at {job.collection} "
                         "(`vlora world` writes the default one)")
    if job.queries not in (None, "world") and not Path(job.queries).is_file():
        raise SystemExit(f"visual_retrieval: no query file at {job.queries} (queries=world makes queries from a "
                         "world's truth; queries=null reads them from stdin)")
    target = connect(cfg, "visual_retrieval")
    run_dir = start_run(cfg, "visual_retrieval")  # sets run_name: out_dir is this run's
    job = job_from_cfg(cfg)
    job.host, job.port, job.token = target.host, target.port, target.token
    server = None
    try:
        if target.own:  # imported here: a client of a running server loads no model code (transformers, torch)
            from .serve import start_server

            server = start_server(cfg, job.token, 4, sources=job.manifest)  # serves what routing reads
            job.port = server.port
        try:
            report = run_queries(job, job.port, stdin, stdout)
        finally:
            if server is not None:
                server.close()
        report["server"] = {"host": job.host, "port": job.port, "own": server is not None, "pid": target.pid}
        if report["mode"] == "batch":
            Path(job.out_dir).mkdir(parents=True, exist_ok=True)
            Path(job.out_dir, "report.json").write_text(json.dumps(report, indent=1))
    except BaseException:
        abandon_run(run_dir)
        raise
    latest = finish_run(cfg.results_dir, run_dir)
    if report["mode"] == "batch":
        print_report(report)
        print(f"results: {report['results']}; report: {Path(job.out_dir, 'report.json')}"
              + (f"; newest run: {latest}" if latest else ""))
    return report
