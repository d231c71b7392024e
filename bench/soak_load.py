"""The soak's careless-client phases: results never polled, disconnects mid-request, and a flood
from one client while another sends single requests (the fairness measurement).

Each phase runs until its time or its count is spent, whichever comes first.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np

from bench.soak_server import latency_summary

FRAME = np.zeros((32, 32, 3), np.uint8)


def unpolled_phase(port: int, token: str, seconds: float, count: int, max_tokens: int) -> dict:
    """One connection submits up to `count` requests and never polls one; it closes at the end."""
    from serve.rpc import Client, ServerError

    outcomes, n = Counter(), 0
    end = time.monotonic() + seconds
    with Client("127.0.0.1", port, token) as client:
        while n < count and time.monotonic() < end:
            try:
                client.submit_image("Describe.", [FRAME], sampling={"max_tokens": max_tokens, "ignore_eos": True})
                outcomes["accepted"] += 1
            except ServerError as e:  # too_many_requests or busy: the server's bound, as it should
                outcomes[e.kind] += 1
                time.sleep(0.05)
            n += 1
        time.sleep(max(0.0, min(1.0, end - time.monotonic())))
    return {"actions": n, "outcomes": dict(outcomes), "ok": outcomes["internal"] == 0}


def disconnect_phase(port: int, token: str, seconds: float, count: int, max_tokens: int,
                     per_connection: int = 3) -> dict:
    """Connect, submit `per_connection` requests, close at once: the server must abort them."""
    from serve.rpc import Client, ServerError

    outcomes, n = Counter(), 0
    end = time.monotonic() + seconds
    while n < count and time.monotonic() < end:
        try:
            with Client("127.0.0.1", port, token, reconnect=False) as client:
                for _ in range(per_connection):
                    client.submit_image("Describe.", [FRAME], sampling={"max_tokens": max_tokens, "ignore_eos": True})
                    outcomes["submitted"] += 1
        except ServerError as e:
            outcomes[e.kind] += 1
        except (EOFError, ConnectionError, OSError):
            outcomes["connection_failed"] += 1
        n += 1
    return {"actions": n, "outcomes": dict(outcomes),
            "ok": outcomes["internal"] == 0 and outcomes["connection_failed"] == 0}


def _flood(port: int, token: str, depth: int, max_tokens: int, stop: threading.Event, stats: Counter) -> None:
    """One client keeping `depth` requests queued until `stop`; it collects its results as they finish."""
    from serve.rpc import Client, ServerError

    with Client("127.0.0.1", port, token) as client:
        pending = []
        while not stop.is_set():
            while len(pending) < depth and not stop.is_set():
                try:
                    pending.append(client.submit_image("Describe.", [FRAME],
                                                       sampling={"max_tokens": max_tokens, "ignore_eos": True}))
                    stats["submitted"] += 1
                except ServerError as e:
                    stats[f"refused_{e.kind}"] += 1
                    break
            finished = 0
            for s in list(pending):
                try:
                    s.poll(0.0)
                except ServerError as e:  # expired: finished past rpc.max_unpolled_per_connection before its poll
                    stats[f"error_{e.kind}"] += 1
                    pending.remove(s)
                    continue
                if s.final is not None:
                    pending.remove(s)
                    finished += 1
            stats["finished"] += finished
            if not finished:
                time.sleep(0.02)
        for s in pending:  # what is still queued is aborted, as a client leaving would
            try:
                s.abort()
            except Exception:  # finished meanwhile
                pass


def flood_phase(port: int, token: str, seconds: float, depth: int, flood_tokens: int, probes: int,
                probe_tokens: int, unloaded_p95_ms: float, max_ratio: float) -> dict:
    """Client A floods (depth requests queued, each flood_tokens long); client B sends single requests
    one after another (up to `probes`, within `seconds`). B's p95 under the flood / its unloaded p95.
    A runs in a process of its own, as the floods' attackers do (bench/soak_floods.py): as a thread of
    this process its 64 polls a round took the interpreter from B's client, and the ratio measured the
    soak's own process as well as the server."""
    from bench.soak_floods import FloodProcess
    from serve.rpc import Client

    flooder = FloodProcess(port, token, "flood", spec=(1, depth, flood_tokens)).start()
    latencies, stats = [], {}
    end = time.monotonic() + seconds
    try:
        flooder.wait_ready(60)
        time.sleep(min(1.0, seconds / 4))  # the flood's queue fills first
        with Client("127.0.0.1", port, token) as client:
            while len(latencies) < probes and time.monotonic() < end:
                start = time.perf_counter()
                client.submit_image("How many cars?", [FRAME],
                                    sampling={"max_tokens": probe_tokens, "ignore_eos": True}).result(
                    max(5.0, end - time.monotonic() + 30.0))
                latencies.append((time.perf_counter() - start) * 1e3)
    finally:
        stats = flooder.stop()
    if not latencies:
        return {"actions": stats.get("submitted", 0), "flood": dict(stats), "probe": None, "ratio": None, "ok": False}
    probe = latency_summary(latencies)
    ratio = probe["p95_ms"] / unloaded_p95_ms
    return {"actions": stats.get("submitted", 0) + len(latencies), "flood": dict(stats), "probe": probe,
            "unloaded_p95_ms": unloaded_p95_ms, "ratio": round(ratio, 2), "max_ratio": max_ratio,
            "ok": ratio <= max_ratio}
