"""`vlora loadtest`: concurrent clients against the RPyC server; throughput, latency and errors.

Each client thread submits requests one after another for `duration_s`: video chunks of the
synthetic world (video analytics) or one image with a question (retrieval), and records each
request's latency. Prints a summary and writes it as JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np
from omegaconf import DictConfig, OmegaConf

from apps.common.stats import percentile
from world import WorldConfig, render_clip, render_image

from ..config import to_dataclass


@dataclass
class LoadJob:
    host: str
    port: int | None
    clients: int
    duration_s: float
    video_share: float
    clip_frames: int
    frame_side: int
    max_tokens_video: int
    max_tokens_image: int
    encoding: str
    seed: int
    out: str


def _media(job: LoadJob, n: int = 8):
    """A few world images and clips, RGB, resized to the job's frame side."""
    world = WorldConfig(seed=job.seed)
    side = (job.frame_side, job.frame_side)
    images = [cv2.resize(render_image(world, i)[0], side)[:, :, ::-1].copy() for i in range(n)]
    clips = []
    for i in range(max(1, n // 4)):
        frames = render_clip(world, i)[0]
        keep = np.linspace(0, len(frames) - 1, job.clip_frames).round().astype(int)
        clips.append(np.stack([cv2.resize(frames[k], side)[:, :, ::-1] for k in keep]))
    return images, clips


def _percentile(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 2) if values else None


def run_load(job: LoadJob, token: str, port: int) -> dict:
    from serve.rpc import Client

    images, clips = _media(job)
    latencies: dict[str, list[float]] = {"video": [], "image": []}
    errors: dict[str, int] = {}
    tokens = [0]
    lock = threading.Lock()
    stop_at = time.monotonic() + job.duration_s

    def client_loop(k: int) -> None:
        rng = np.random.default_rng(job.seed + k)
        try:
            client = Client(job.host, port, token, encoding=job.encoding)
        except Exception as e:
            with lock:
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            return
        with client:
            while time.monotonic() < stop_at:
                video = rng.random() < job.video_share
                start = time.perf_counter()
                try:
                    if video:
                        final = client.submit_video("Which way is the traffic moving?", clips[rng.integers(len(clips))],
                                                    sampling={"max_tokens": job.max_tokens_video}, app="video_analytics").result()
                    else:
                        final = client.submit_image("How many cars are there?", [images[rng.integers(len(images))]],
                                                    sampling={"max_tokens": job.max_tokens_image}, app="visual_retrieval").result()
                except Exception as e:
                    with lock:
                        errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                    continue
                with lock:
                    latencies["video" if video else "image"].append((time.perf_counter() - start) * 1e3)
                    tokens[0] += len(final["token_ids"])

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(job.clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    summary = {"clients": job.clients, "duration_s": round(elapsed, 3), "errors": errors, "tokens": tokens[0],
               "tokens_per_s": round(tokens[0] / elapsed, 2)}
    for kind, values in latencies.items():
        summary[kind] = {"requests": len(values), "per_s": round(len(values) / elapsed, 3),
                         **{f"p{q}_ms": _percentile(values, q) for q in (50, 95, 99)},
                         "mean_ms": round(statistics.fmean(values), 2) if values else None}
    return summary


def run(cfg: DictConfig) -> dict:
    job = to_dataclass(LoadJob, cfg.loadtest)
    token = str(cfg.rpc.token)
    server = None
    port = job.port
    if port is None:
        from .serve import start_server

        server = start_server(cfg, token, job.clients)
        port = server.port
    print(f"vlora loadtest: {job.clients} clients for {job.duration_s} s against {job.host}:{port}",
          file=sys.stderr, flush=True)
    try:
        summary = run_load(job, token, port)
    finally:
        if server is not None:
            summary_server = server.state.counters.copy()
            server.close()
    if server is not None:
        summary["server_counters"] = dict(summary_server)
    summary["job"] = asdict(job)
    Path(job.out).parent.mkdir(parents=True, exist_ok=True)
    Path(job.out).write_text(json.dumps(summary, indent=1))
    for kind in ("video", "image"):
        s = summary[kind]
        print(f"{kind:>5}: {s['requests']} requests ({s['per_s']}/s), p50 {s['p50_ms']} ms, p95 {s['p95_ms']} ms, "
              f"p99 {s['p99_ms']} ms")
    print(f"tokens/s {summary['tokens_per_s']}, errors {summary['errors'] or 'none'}; written to {job.out}")
    return summary
