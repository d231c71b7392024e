"""One point of the streams evaluation: N camera streams against a fresh RPyC server on loopback.

The cameras run in a process of their own (spawned per point), each stream a thread with its own
connection. Stream i sends chunk k at `t0 + i / N + k`
seconds (one chunk per second, streams staggered over the first second) whether or not its
earlier chunks are answered, as a camera would, and polls its pending chunks in between. A
chunk's latency is measured on the stream's thread from just before `submit_video` to the poll
that returns its final event. Every send stamps a counter into the first frame's corner, so no
two chunks share pixels and the server's encoder and prefix caches cannot answer one chunk from
another (a real camera never repeats a frame exactly either).

Chunks sent in the first `warmup_s` (rounded up to whole seconds) are not measured; the next
`seconds` (rounded up) are. Chunks still pending `drain_s` after a stream's last send are
aborted and count at the time waited (a lower bound of their latency). Throughput is the number
of answers, from any chunk, that arrive within the measured seconds, per second (`chunks_per_s`);
an overloaded point answers late, so `served_per_s` also counts every answer over the time from
the first send to the last answer.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
import sys
import threading
import time
from collections import Counter

import numpy as np

from apps.common.stats import percentile

HEAD_TASK = "vehicle"  # the head bench.adapters.write_head saves beside each adapter
TIMING_KEYS = ("frame_decode_ms", "preprocess_ms", "queue_ms", "prefill_ms", "decode_ms")


STAMP_BITS, STAMP_BLOCK = 32, 8


def _stamped(chunk: np.ndarray, serial: int, every_frame: bool = True) -> np.ndarray:
    """A copy of chunk (uint8 [T, H, W, 3]) whose frames carry `serial` as 32 black or white 8x8
    blocks along the top (wrapping to the next rows on a narrow frame): a pattern JPEG keeps, so
    every send differs in its bytes and pixels (a few changed pixel values did not survive the
    codec: pooled chunks came back byte for byte, and caches answered them). Every frame, so no frame
    group of a moving camera's chunk repeats one sent before, or only the first (a static camera,
    whose later groups do repeat)."""
    frames = chunk.copy()
    per_row = frames.shape[2] // STAMP_BLOCK
    target = frames if every_frame else frames[:1]
    for bit in range(STAMP_BITS):
        r, c = divmod(bit, per_row)
        target[:, r * STAMP_BLOCK:(r + 1) * STAMP_BLOCK, c * STAMP_BLOCK:(c + 1) * STAMP_BLOCK] = \
            255 if (int(serial) >> bit) & 1 else 0
    return frames


def run_point(engine, job, mode: str, n: int, chunks: list[np.ndarray], adapters: list[str],
              seconds: float | None = None, cold: bool = False, profile: int = 0) -> dict:
    """Runs n streams; returns the point's row. `seconds` given: an unmeasured warm-up of that length.
    cold: the point right after the server is ready, measured from its first chunk for `cold_seconds`.
    profile > 0: the engine's first `profile` steps of the point run under torch.profiler (row `step_profiles`).
    engine: the bench's engine (its loop on a thread of a fresh server) or a bench.streams_served.Served.

    The cameras (client threads) run in a process of their own, as real cameras would: in the
    server's process their encoding and polling would take the server's interpreter lock, and past
    capacity (more chunks pending, more polls) starve the engine loop itself."""
    import dataclasses
    from types import SimpleNamespace

    from .streams_served import Served, abort_all, marks, since

    if getattr(job, "transport", "rpc") == "http":  # the same point through the OpenAI-compatible API
        from .streams_http import run_http_point

        return run_http_point(engine, job, mode, n, chunks, adapters, seconds, cold)
    served = engine if isinstance(engine, Served) else Served(engine)
    warm_up = seconds is not None
    first = 0 if warm_up or cold else math.ceil(job.warmup_s)  # index of the first measured chunk of a stream
    measured = math.ceil(seconds if warm_up else job.cold_seconds if cold else job.seconds)
    leftover = served.run(abort_all)  # each point starts from an idle engine (a point's drain said so, or this does)
    with served.server(n, cold) as (server, warm_s):
        if warm_s is not None:
            _log(f"engine warm-up on the server's thread: {served.engine.warm_report.line()}")
        # counted from here: a warm-up on the server's thread is not the point's (its steps were counted in once)
        before = served.run(marks)
        if profile:
            served.run(operator.methodcaller("profile_steps", profile))  # serve/engine/step_profiler.py
        label = "warm-up " if warm_up else "cold " if cold else ""
        _log(f"{label}mode={mode} streams={n}: {first + measured} chunks each")
        plain = SimpleNamespace(**dataclasses.asdict(job))  # the camera process needs no torch to read it
        with gc_pauses() as pauses:  # the server's process: the connections' threads (and the engine's, on a thread)
            records, errors, t0 = run_cameras(_cameras, (plain, mode, n, server.port, served.token, chunks, adapters,
                                                         first, first + measured), first + measured + job.drain_s + 120)
        settled = _settle(server)
    row = _row(job, mode, n, records, Counter(errors), t0 + first, measured)
    # the measured seconds on the wall clock (t0 is the cameras' perf_counter, the same monotonic clock in every
    # process), to read a point beside a device log sampled each second (nvidia-smi dmon)
    row["window_utc"] = [_utc(t0 + first), _utc(t0 + first + measured)]
    if warm_s is not None:
        row["server_warm_up_s"] = warm_s
    if profile:
        row["step_profiles"] = served.run(operator.methodcaller("step_profiles"))
    row.update(point="warm-up" if warm_up else "cold" if cold else "warm", settled=settled, leftover_before=leftover,
               **served.run(functools.partial(since, before=before, first=30 if cold else 0)),
               engine_process=not served.in_thread, gc=pauses.summary())
    row["gc_full_ms"] = row["gc"]["full_ms"]  # a full collection in the front end stalls every connection (in the table)
    _log(label + " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k not in TIMING_KEYS + ("first_steps", "first_phases_ms", "first_between_ms", "step_profiles")))
    return row


def encoded_since(engine, before: dict) -> dict:
    """Pictures through the tower since `before` (dict(engine.runner.counters)): 3 a chunk, once; how many of
    them were encoded during the step before theirs (encode_ahead), and how many such tries failed."""
    return {k: engine.runner.counters[k] - before[k]
            for k in ("items_encoded", "items_encoded_ahead", "encode_ahead_failures")}


def run_cameras(target, args: tuple, timeout_s: float) -> tuple:
    """Runs target(*args, results) in a spawned camera process; returns what it puts on results
    ((records, errors, t0)), or raises when it ends without or runs past timeout_s."""
    import multiprocessing
    import queue

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    cameras = ctx.Process(target=target, args=(*args, results), name="cameras", daemon=True)
    cameras.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                if not cameras.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the camera process ended without results (exit code {cameras.exitcode})")
    finally:
        cameras.join(timeout=30)
        if cameras.is_alive():
            cameras.kill()


def _cameras(job, mode: str, n: int, port: int, token: str, chunks: list[np.ndarray], adapters: list[str],
             first: int, sends: int, results) -> None:
    """The camera process: n client threads, one connection each; puts (records, errors, t0)."""
    from serve.rpc import Client, ServerError

    sampling = {"max_tokens": job.answer_tokens, "ignore_eos": True}
    clients = [Client("127.0.0.1", port, token, encoding=job.encoding) for _ in range(n)]
    records: list[dict] = []
    errors: Counter[str] = Counter()
    lock = threading.Lock()
    serials = itertools.count(int(time.time() * 1e6))  # unique across points too
    t0 = time.perf_counter() + 0.2

    def finish(i: int, k: int, sent: float, final: dict | None) -> None:
        done = time.perf_counter()
        record = {"stream": i, "chunk": k, "sent": sent, "done": done, "latency_ms": (done - sent) * 1e3,
                  "measured": k >= first, "finished": final is not None}
        if final is not None:
            record.update({key: final["timing"].get(key) for key in (*TIMING_KEYS, "prompt_tokens")})
            wrong = ("no_head" if mode == "head" and not final.get("head")
                     else "short_answer" if mode == "generate" and len(final["token_ids"]) != job.answer_tokens
                     else None)
            if wrong:
                with lock:
                    errors[wrong] += 1
        with lock:
            records.append(record)

    def stream(i: int) -> None:
        client, adapter, offset = clients[i], adapters[i % len(adapters)], i / n
        pending: list[tuple] = []  # (Stream, chunk index, send time)
        k = 0
        deadline = t0 + offset + sends - 1 + job.drain_s
        while True:
            now = time.perf_counter()
            if k < sends and now >= t0 + offset + k:
                frames = _stamped(chunks[(i + k * n) % len(chunks)], next(serials), not job.static_camera)
                sent = time.perf_counter()
                try:
                    s = client.submit_video(job.prompt, frames, adapter=adapter, output_mode=mode,
                                            sampling=sampling, task=HEAD_TASK if mode == "head" else None,
                                            app="video_analytics", slo_ms=job.target_ms, tag=f"{i}/{k}")
                    pending.append((s, k, sent))
                except Exception as e:  # a refused submission is this point's failure, not the run's
                    with lock:
                        errors[f"submit_{type(e).__name__}"] += 1
                k += 1
                continue
            if not pending:
                if k >= sends:
                    return
                time.sleep(max(0.0, t0 + offset + k - now))
                continue
            if k >= sends and now > deadline:
                for s, kk, sent in pending:
                    try:
                        s.abort()
                    except Exception:  # finished meanwhile, or the connection is gone
                        pass
                    finish(i, kk, sent, None)
                return
            until = t0 + offset + k if k < sends else deadline
            for j, (s, kk, sent) in enumerate(list(pending)):
                try:  # wait on the oldest chunk (usually the next to finish); only glance at the others
                    s.poll(max(0.0, min(0.05, until - now)) if j == 0 else 0.0)
                except ServerError as e:
                    with lock:
                        errors[e.kind] += 1
                    pending.remove((s, kk, sent))
                    continue
                if s.final is not None:
                    finish(i, kk, sent, s.final)
                    pending.remove((s, kk, sent))

    threads = [threading.Thread(target=stream, args=(i,), name=f"stream-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    results.put((records, dict(errors), t0))


def _holds_requests(engine) -> bool:  # module-level: it crosses to an engine process
    return engine.has_unfinished()


def _settle(server, timeout_s: float = 60.0) -> bool:
    """Waits until the engine holds no request (aborts of late chunks have been carried out); False
    if it still held some after timeout_s (the next point aborts them before it starts)."""
    deadline = time.monotonic() + timeout_s
    while server.loop.call(_holds_requests):  # on the engine's thread, or in its process
        if time.monotonic() > deadline:
            _log(f"the engine still held requests {timeout_s:g} s after the point's drain")
            return False
        time.sleep(0.05)
    return True


class _GcPauses:
    """Python's garbage collections while a point ran: each stops every thread of the server's process."""

    def __init__(self):
        self.pauses: list[tuple[int, float]] = []  # (generation, ms)
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], (time.perf_counter() - self._start) * 1e3))

    def summary(self) -> dict:
        full = [ms for gen, ms in self.pauses if gen == 2]
        return {"collections": len(self.pauses), "full": len(full), "max_ms": round(max((ms for _, ms in self.pauses),
                default=0.0), 2), "full_ms": round(sum(full), 2)}


@contextlib.contextmanager
def gc_pauses():
    import gc

    watch = _GcPauses()
    gc.callbacks.append(watch)
    try:
        yield watch
    finally:
        gc.callbacks.remove(watch)


def _steps(engine, n: int, first: int = 0) -> dict:
    """The point's engine steps: how many, and the slowest five as (sequences, tokens, ms), which is
    where a compile on first use shows (a step seconds long among steps of tens of ms); `phase_ms`, the
    mean host time per step in each of the runner's phases, and `between_ms`, before each step; `first` > 0: also
    its first steps in order, with both (a cold point's: where a backlog starts, and whether its steps waited on
    the host)."""
    log = list(engine.step_log)[-n:] if n > 0 else []
    slow = sorted(log, key=lambda e: -e[3])[:5]
    out = {"steps": n, "step_max_ms": slow[0][3] * 1e3 if slow else math.nan,
           "slow_steps": [[seqs, tokens, round(s * 1e3, 1)] for seqs, tokens, _, s in slow]}
    # the runner's host phases of the same steps (ModelRunner.PHASES): a step whose host phases are long (not its
    # wait for the device) left the device idle meanwhile
    runner = getattr(engine, "runner", None)
    # and before each step: the serving loop's time since the previous one ended, and the step's planning
    for mean_key, first_key, entries, names in (
            ("phase_ms", "first_phases_ms", getattr(runner, "phase_log", ()), getattr(runner, "PHASES", ())),
            ("between_ms", "first_between_ms", getattr(engine, "between_log", ()), ("loop", "plan"))):
        per_step = list(entries)[-n:] if n > 0 else []
        if not per_step or len(per_step) != len(log):
            continue
        out[mean_key] = {k: round(sum(p[i] for p in per_step) / len(per_step) * 1e3, 2) for i, k in enumerate(names)}
        if first:
            out[first_key] = [[round(x * 1e3, 1) for x in p] for p in per_step[:first]]
    if first:
        out["first_steps"] = [[seqs, tokens, round(s * 1e3, 1)] for seqs, tokens, _, s in log[:first]]
    return out


def _row(job, mode: str, n: int, records: list[dict], errors: Counter, window_start: float, seconds: int) -> dict:
    measured = [r for r in records if r["measured"]]
    latencies = [r["latency_ms"] for r in measured]
    done = [r for r in measured if r["finished"]]
    # answers of any chunk arriving within the measured seconds (stream offsets lie in [0, 1))
    answered = sum(r["finished"] and window_start <= r["done"] < window_start + seconds for r in records)
    finished = [r for r in records if r["finished"]]
    # answered chunks (warm-up ones too) over the time from the first send to the last answer, less
    # one (n answers span n - 1 intervals): the rate actually served, which an overloaded point still tells
    span = max((r["done"] for r in finished), default=0.0) - min((r["sent"] for r in records), default=0.0)
    p50, p95, p99 = (percentile(latencies, q) for q in (50, 95, 99))
    unfinished = len(measured) - len(done)
    trend = latency_trend(measured)
    # a backlog growing under the target now crosses it later: the p95 carried to `sustain_s` by the trend
    projected = p95 + max(0.0, trend) * max(0.0, job.sustain_s - seconds) if latencies else math.nan
    ok = (bool(latencies) and p95 <= job.target_ms and unfinished == 0 and not errors
          and not projected > job.target_ms)
    row = {"mode": mode, "streams": n, "offered_per_s": float(n), "sent": len(measured), "done": len(done),
           "unfinished": unfinished, "errors": sum(errors.values()), "error_kinds": dict(errors),
           "p50_ms": p50, "p95_ms": p95, "p99_ms": p99,
           "mean_ms": float(np.mean(latencies)) if latencies else math.nan,
           "max_ms": max(latencies) if latencies else math.nan,
           "chunks_per_s": answered / seconds, "served_per_s": (len(finished) - 1) / span if span > 0 else 0.0,
           "latency_trend_ms_per_s": trend, "projected_p95_ms": projected, "pass": ok,
           "prompt_tokens": float(np.mean([r["prompt_tokens"] for r in done])) if done else math.nan}
    for key in TIMING_KEYS:
        values = [r[key] for r in done if r.get(key) is not None]
        row[key] = float(np.mean(values)) if values else math.nan
    return row


def latency_trend(records: list[dict]) -> float:
    """How fast chunk latency grows with send time, in ms per second: the least-squares slope less twice its
    standard error, so that only growth the window shows clearly counts (0 when it shows none). A point
    that serves a little less than it is sent keeps its p95 under the target for a short window while its
    backlog grows: 38 cameras on a GPU serving 36 chunks/s passed 8 s at p95 0.8 s and failed 40 s at 2.2 s."""
    if len(records) < 3:
        return 0.0
    t = np.array([r["sent"] for r in records])
    y = np.array([r["latency_ms"] for r in records])
    t = t - t.mean()
    spread = float((t * t).sum())
    if spread <= 0:
        return 0.0
    slope = float((t * (y - y.mean())).sum() / spread)
    residual = y - y.mean() - slope * t
    se = math.sqrt(float((residual * residual).sum()) / (len(y) - 2) / spread)
    return max(0.0, slope - 2 * se)


def _utc(perf: float) -> str:
    """HH:MM:SS.s (UTC) of a time.perf_counter() reading."""
    wall = time.time() - (time.perf_counter() - perf)
    return time.strftime("%H:%M:%S", time.gmtime(wall)) + f".{int(wall * 10) % 10}"


def _log(message: str) -> None:
    print(f"[streams {time.strftime('%H:%M:%S', time.gmtime())}] {message}", file=sys.stderr, flush=True)
