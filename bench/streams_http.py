"""The streams suite over HTTP: the same camera chunks through the OpenAI-compatible API (serve.http)
instead of RPyC, and the two transports compared on one engine.

`run_http_point` is bench.streams_load.run_point with the cameras speaking HTTP: each chunk one
`POST /v1/chat/completions` with its frames as JPEG (or PNG) data URLs in a `video` part and the
head asked through the `vlora` extension, sent at the same times (stream i's chunk k at
`t0 + i / N + k`, whether or not earlier chunks are answered), latency measured from just before the
request to its response, rows made by the same `_row`. `compare` runs both transports at each
stream count, alternating (with `--repeats R`, R times, every other repeat HTTP first), on one engine built
as the streams suite builds it:

    python -m bench.streams_http --counts 16 32 48                       # a GPU: Qwen2-VL-7B shape
    python -m bench.streams_http --model qwen2_vl_tiny --device cpu --image-size 56 --counts 1 2 --seconds 3

It writes transports.csv / transports.json under results/streams_http/<device>/, with the HTTP to
RPyC ratio of chunks/s and p95 latency per count.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import math
import secrets
import sys
import time
from collections import Counter

import numpy as np

from .streams_load import (HEAD_TASK, TIMING_KEYS, _log, _row, _settle, _stamped, _steps, encoded_since, gc_pauses,
                           run_cameras)


def run_http_point(engine, job, mode: str, n: int, chunks: list[np.ndarray], adapters: list[str],
                   seconds: float | None = None, cold: bool = False) -> dict:
    """bench.streams_load.run_point over HTTP: n streams against a fresh server on loopback."""
    import dataclasses
    from types import SimpleNamespace

    from serve.http import HttpConfig, HttpServer
    from serve.rpc import Limits, RpcServer

    if job.encoding not in ("jpeg", "png"):
        raise ValueError(f"encoding={job.encoding!r}: HTTP carries frames as jpeg or png data URLs")
    warm_up = seconds is not None
    first = 0 if warm_up or cold else math.ceil(job.warmup_s)
    measured = math.ceil(seconds if warm_up else job.cold_seconds if cold else job.seconds)
    leftover = engine.abort_all()  # each point starts from an idle engine, as run_point's
    steps_before, encoded_before = engine.num_steps, dict(engine.runner.counters)
    token = secrets.token_hex(16)
    server = RpcServer(engine, token, "127.0.0.1", 0, Limits(), max_connections=8).start()
    http = HttpServer(server.state, HttpConfig(port=0, max_concurrent=max(256, 8 * n)), "base").start()
    _log(f"{'warm-up ' if warm_up else ''}http mode={mode} streams={n}: {first + measured} chunks each")
    plain = SimpleNamespace(**dataclasses.asdict(job))
    with gc_pauses() as pauses:  # the server's process: the engine's thread, the HTTP loop and its workers
        records, errors, t0 = run_cameras(_http_cameras, (plain, mode, n, http.port, token, chunks, adapters, first,
                                                          first + measured), first + measured + job.drain_s + 120)
    settled = _settle(server)
    http.close()
    server.close()
    row = {"transport": "http", **_row(job, mode, n, records, Counter(errors), t0 + first, measured)}
    row.update(point="warm-up" if warm_up else "cold" if cold else "warm", settled=settled, leftover_before=leftover,
               **_steps(engine, engine.num_steps - steps_before), **encoded_since(engine, encoded_before),
               gc=pauses.summary())
    _log(("warm-up " if warm_up else "") + "http " + " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k in SHOWN))
    return row


SHOWN = ("mode", "streams", "done", "unfinished", "errors", "p50_ms", "p95_ms", "chunks_per_s", "served_per_s")


def _data_urls(frames: np.ndarray, encoding: str) -> list[str]:
    import cv2

    mime, ext = ("image/jpeg", ".jpg") if encoding == "jpeg" else ("image/png", ".png")
    params = [cv2.IMWRITE_JPEG_QUALITY, 90] if encoding == "jpeg" else []  # serve.rpc.encode_frame's quality
    return [f"data:{mime};base64," + base64.b64encode(cv2.imencode(ext, f[:, :, ::-1], params)[1]).decode()
            for f in frames]


def _http_cameras(job, mode: str, n: int, port: int, token: str, chunks: list[np.ndarray], adapters: list[str],
                  first: int, sends: int, results) -> None:
    """The camera process: n streams on one event loop, each chunk one request; puts (records, errors, t0)."""
    import asyncio

    import httpx

    records: list[dict] = []
    errors: Counter[str] = Counter()
    serials = itertools.count(int(time.time() * 1e6))
    vlora = {"app": "video_analytics", "slo_ms": job.target_ms}
    if mode == "head":
        vlora.update(output="head", task=HEAD_TASK)

    async def chunk(http, i: int, k: int, at: float, end: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        frames = _stamped(chunks[(i + k * n) % len(chunks)], next(serials), not job.static_camera)
        sent = time.perf_counter()
        # encoded on a worker thread, as each RPyC camera encodes on its own: on the one event loop, n streams'
        # JPEG encodes would queue behind each other and count in every later chunk's latency
        urls = await asyncio.to_thread(_data_urls, frames, job.encoding)
        body = {"model": adapters[i % len(adapters)], "max_tokens": job.answer_tokens, "ignore_eos": True,
                "vlora": vlora, "messages": [{"role": "user", "content": [
                    {"type": "video", "video": urls}, {"type": "text", "text": job.prompt}]}]}
        final = None
        try:
            response = await asyncio.wait_for(http.post("/v1/chat/completions", json=body), max(0.1, end - sent))
            if response.status_code != 200:
                errors[f"http_{response.status_code}"] += 1
            else:
                final = response.json()
        except asyncio.TimeoutError:  # unanswered drain_s after the stream's last send: aborted, counted
            pass
        except httpx.HTTPError as e:
            errors[f"submit_{type(e).__name__}"] += 1
        done = time.perf_counter()
        record = {"stream": i, "chunk": k, "sent": sent, "done": done, "latency_ms": (done - sent) * 1e3,
                  "measured": k >= first, "finished": final is not None}
        if final is not None:
            timing = (final.get("vlora") or {}).get("timing") or {}
            record.update({key: timing.get(key) for key in TIMING_KEYS}, prompt_tokens=final["usage"]["prompt_tokens"])
            if mode == "head" and not (final.get("vlora") or {}).get("head"):
                errors["no_head"] += 1
            elif mode == "generate" and final["usage"]["completion_tokens"] != job.answer_tokens:
                errors["short_answer"] += 1
        records.append(record)

    async def main(t0: float) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=8 * n)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=None,
                                     headers={"Authorization": f"Bearer {token}"}) as http:
            await asyncio.gather(*(chunk(http, i, k, t0 + i / n + k, t0 + i / n + sends - 1 + job.drain_s)
                                   for i in range(n) for k in range(sends)))

    t0 = time.perf_counter() + 0.5
    asyncio.run(main(t0))
    results.put((records, dict(errors), t0))


def compare(job, counts: tuple[int, ...], out_dir: str = "results/streams_http", repeats: int = 1) -> list[dict]:
    """Head mode over RPyC and over HTTP at each count, `repeats` times, on one engine; writes transports.csv/.json."""
    import tempfile
    from pathlib import Path

    from .engine import build_random_model
    from .results import device_label, results_dir, write_csv, write_json
    from .streams import _engine, render_chunks
    from .streams_hf import chunk_flops
    from .streams_load import run_point

    workdir = Path(tempfile.mkdtemp(prefix="streams-http-"))
    hf, processor = build_random_model(job.model, job.seed, job.dtype, job.device, workdir)
    chunks = render_chunks(job)
    engine, names = _engine(job, workdir, hf, chunk_flops(hf, processor, job, chunks[0])["prompt_tokens"])
    if job.engine_warm_up and engine.needs_warm_up:  # else the first point's server would answer "warming"
        _log(f"engine warm-up: {engine.warm_up(side=job.image_size, frames=job.frames_per_chunk).line()}")
    if job.warmup_point_s > 0:
        run_point(engine, job, "head", min(counts), chunks, names, seconds=job.warmup_point_s)
    rows = []
    for rep in range(repeats):  # near capacity one point is noisy: repeats, each other one HTTP first (order bias)
        for n in counts:
            runs = {}
            for order, transport in enumerate(("rpc", "http") if rep % 2 == 0 else ("http", "rpc")):
                point = run_point if transport == "rpc" else run_http_point
                runs[transport] = {"transport": transport, "repeat": rep, "order": order,
                                   **point(engine, job, "head", n, chunks, names)}
            rpc, http = runs["rpc"], runs["http"]
            for key in ("chunks_per_s", "served_per_s", "p95_ms"):
                http[f"{key}_vs_rpc"] = http[key] / rpc[key] if rpc[key] else math.nan
            rows += [rpc, http]
    device = device_label(job.device)
    out = results_dir(out_dir, device)
    columns = ["transport", "repeat", "order", *SHOWN, "chunks_per_s_vs_rpc", "served_per_s_vs_rpc", "p95_ms_vs_rpc"]
    write_csv(out / "transports.csv", rows, columns, drop_extra=True)
    write_json(out / "transports.json", {"device": device, "date": time.strftime("%Y-%m-%d"),
                                         "command": " ".join(["python -m bench.streams_http", *sys.argv[1:]]),
                                         "job": {k: v for k, v in vars(job).items()}, "rows": rows})
    return rows


def main(argv: list[str] | None = None) -> None:
    from .streams import StreamsBenchJob

    p = argparse.ArgumentParser(prog="python -m bench.streams_http", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2_vl_7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--image-size", type=int, default=448)
    p.add_argument("--counts", type=int, nargs="+", default=[16, 32, 48])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--encoding", default="jpeg", choices=("jpeg", "png"))
    p.add_argument("--out-dir", default="results/streams_http")
    p.add_argument("--repeats", type=int, default=1, help="every count this many times, alternating which transport goes first")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error(f"--repeats must be at least 1, got {a.repeats}")
    job = StreamsBenchJob(model=a.model, device=a.device, image_size=a.image_size, seconds=a.seconds,
                          encoding=a.encoding, modes=("head",), stream_counts=tuple(a.counts), engine_only=False,
                          hf_baseline=False, chunk_pool=min(32, 4 * max(a.counts)))
    for row in compare(job, tuple(a.counts), a.out_dir, a.repeats):
        print(" ".join(f"{k}={row[k]:.4g}" if isinstance(row.get(k), float) else f"{k}={row.get(k)}"
                       for k in ("transport", "repeat", *SHOWN, "chunks_per_s_vs_rpc") if k in row))


if __name__ == "__main__":
    main()
