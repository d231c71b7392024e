"""The soak's fairness floods: an attacker tenant loads the server in one of several ways while a
victim tenant sends single requests one after another; the victim's p95 over its unloaded p95
(measured right before each flood) is the fairness ratio (target: 2x).

The flood runs in a process of its own, so that its client threads do not compete with the
victim's client for one interpreter: what is measured is the server, not the soak's own process.

    long        one connection keeping 256 requests of 200 tokens queued
    topup4      four connections each topping up 8 one-token requests
    queue2048   eight connections keeping 256 one-token requests queued each (2,048 in all)
    topup32     32 connections each topping up 8 one-token requests
    poll32      32 connections calling poll() in a loop, no engine work at all
    httppoll32  32 kept-alive HTTP connections asking GET /v1/models in a loop (the server's HTTP port)
    http401x32  the same with a wrong token: requests refused before any tenant is known
    own64       one connection of the victim's own tenant keeping 64 requests of 16 tokens queued: one
                team's camera flooding, another of its connections asking (the tenant rules do not part them)
    none        no flood: the victim's probes alone, measured the same way (where its time goes unloaded)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections import Counter

import numpy as np

from bench.soak_cpu import CpuWindow
from bench.soak_server import latency_summary
from serve.engine.request import STEP_PHASES

FRAME = np.zeros((32, 32, 3), np.uint8)
FLOODS = {"long": (1, 256, 200), "topup4": (4, 8, 1), "queue2048": (8, 256, 1), "topup32": (32, 8, 1),
          "poll32": (32, 0, 0), "httppoll32": (32, 0, 0), "http401x32": (32, 0, 0), "own64": (1, 64, 16),
          "none": (0, 0, 0)}  # name -> (connections, requests kept queued per connection, tokens each)
OWN_FLOODS = {"own64"}  # sent with the victim's token: another connection of its own tenant
HTTP_FLOODS = {"httppoll32", "http401x32"}  # at the server's HTTP port: the soak opens one when a flood named here runs


def _poll_loop(port: int, token: str, stop, stats: Counter) -> None:
    from serve.rpc import Client

    with Client("127.0.0.1", port, token) as client:
        root = client._conn.root
        while not stop.is_set():
            root.poll("c0-0", 0.0)  # an id of no request: answered at once, no engine work
            stats["calls"] += 1


def _http_poll_loop(port: int, token: str, stop, stats: Counter) -> None:
    import http.client

    headers = {"Authorization": f"Bearer {token}"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop.is_set():
        try:
            conn.request("GET", "/v1/models", headers=headers)
            reply = conn.getresponse()
            reply.read()
            stats["calls" if reply.status == 200 else f"http_{reply.status}"] += 1
        except (OSError, http.client.HTTPException):  # closed by the server: a new connection
            stats["reconnects"] += 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.close()


def _flood_process(port: int, token: str, name: str, ready, stop, out, nice: int = 0, spec: tuple | None = None) -> None:
    """In the flood's own process: the connections of flood `name` (or of `spec`: connections, requests
    kept queued per connection, tokens each) until `stop` is set, at niceness `nice` (the flood's client
    threads are the attacker's machines, not the server's)."""
    import os

    from bench.soak_load import _flood

    if nice:
        os.nice(nice)

    connections, depth, tokens = spec or FLOODS[name]
    stats: Counter = Counter()
    local_stop = threading.Event()
    if name in HTTP_FLOODS:  # `port` is the HTTP port
        wrong = "wrong-" + token if name == "http401x32" else token
        target = lambda: _http_poll_loop(port, wrong, local_stop, stats)  # noqa: E731
    elif depth == 0:
        target = lambda: _poll_loop(port, token, local_stop, stats)  # noqa: E731
    else:
        target = lambda: _flood(port, token, depth, tokens, local_stop, stats)  # noqa: E731
    threads = [threading.Thread(target=target, daemon=True) for _ in range(connections)]
    for t in threads:
        t.start()
    ready.set()
    stop.wait()
    local_stop.set()
    for t in threads:
        t.join(60)
    out.put(dict(stats))


class FloodProcess:
    """A flood's client connections in a process of their own (`_flood_process`, spawned): start(), then
    wait_ready(), then stop() ends them and returns what the flood did (its counts; {} if its process died)."""

    def __init__(self, port: int, token: str, name: str, nice: int = 0, spec: tuple | None = None):
        ctx = mp.get_context("spawn")
        self._ready, self._stop, self._out = ctx.Event(), ctx.Event(), ctx.Queue()
        self._proc = ctx.Process(target=_flood_process, args=(port, token, name, self._ready, self._stop, self._out,
                                                              nice, spec), daemon=True)

    def start(self) -> "FloodProcess":
        self._proc.start()
        return self

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        self._ready.wait(timeout_s)

    def stop(self) -> dict:
        self._stop.set()
        try:
            stats = self._out.get(timeout=90)
        except Exception:  # the flood process died: what it did is unknown
            stats = {}
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
        return stats


PARTS = ("submit_ms", "frame_decode_ms", "preprocess_ms", "queue_ms", "prefill_ms", "decode_ms", "pipe_ms", "after_ms")
STEP_PARTS = ("steps", "step_ms", "step_tokens", "intake_ms", "plan_ms", "graph_steps", "first_step_ms",
              "first_step_tokens", "first_step_cpu_ms", "last_step_ms", "last_step_cpu_ms", "steps_before",
              "lingered_before_ms", "gc_before_ms", "gc_ms", "passed_over")
# the host phases (serve/engine/request.py STEP_PHASES) of its first step and of its last (a probe's decode step)
PHASE_PARTS = tuple(f"{when}_{phase}_ms" for when in ("first", "last") for phase in STEP_PHASES)


def _parts(total_ms: float, submit_ms: float, timing: dict) -> dict:
    """One probe's time by where it went: the submit call (the client's round trip: the gate's wait,
    frame decoding, preparation, the hand-off to the engine), inside it frame decoding and
    preparation, then the engine's queue, prefill and decode, and `after_ms`: the rest (the final
    event's way back through the front end and the client's poll), of which `pipe_ms` is its way
    from the engine process to the front end."""
    engine = sum(timing.get(k) or 0.0 for k in ("queue_ms", "prefill_ms", "decode_ms"))
    server = timing.get("total_ms") or 0.0  # the front end's start of the submit to the engine's final
    return {"total_ms": total_ms, "submit_ms": submit_ms, **{k: timing.get(k) or 0.0 for k in PARTS[1:-1]},
            "after_ms": total_ms - submit_ms - engine,
            # the hand-off in (prepared -> the engine takes it) and the way out (the engine's final,
            # through the front end and the poll, to the client; at most this, with the submit's gate wait)
            "handoff_ms": server - engine - (timing.get("frame_decode_ms") or 0.0) - (timing.get("preprocess_ms") or 0.0),
            "out_ms": total_ms - server - (timing.get("pipe_ms") or 0.0),
            # prefill + decode by where: its steps' run (of which arrivals taken in mid-step), the planning
            # of its later steps, and the loop between them (outputs handed out, arrivals, waits)
            **{k: timing.get(k) or 0.0 for k in STEP_PARTS}, "passed_reason": timing.get("passed_reason") or "",
            **{f"{when}_{phase}_ms": (timing.get(f"{when}_phases_ms") or {}).get(phase, 0.0)
               for when in ("first", "last") for phase in STEP_PHASES},
            "between_ms": sum(timing.get(k) or 0.0 for k in ("prefill_ms", "decode_ms"))
            - (timing.get("step_ms") or 0.0) - (timing.get("plan_ms") or 0.0)}


def _rounded(part: dict) -> dict:
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in part.items()}


def where_the_time_goes(parts: list[dict]) -> dict:
    """The mean of each part over all probes and over the slowest tenth (the tail that sets p95)."""
    if not parts:
        return {}
    tail = sorted(parts, key=lambda p: p["total_ms"])[-max(1, len(parts) // 10):]
    mean = lambda rows, k: round(sum(r[k] for r in rows) / len(rows), 2)  # noqa: E731
    keys = ("total_ms", *PARTS, "handoff_ms", "out_ms", *STEP_PARTS, "between_ms", *PHASE_PARTS)
    return {"all": {k: mean(parts, k) for k in keys}, "tail": {k: mean(tail, k) for k in keys}}


def ratio_interval(loaded_ms: list[float], quiet_ms: list[float], q: float = 95.0, resamples: int = 2000,
                   seed: int = 0) -> list[float] | None:
    """A 95% bootstrap interval of p_q(loaded) / p_q(quiet): both samples resampled with replacement,
    independently. A p95 of a few dozen probes is its second- or third-largest value; the interval says
    how far the ratio could move in a rerun, so a ratio near the target is not read as a pass or a miss
    on its own."""
    if len(loaded_ms) < 2 or len(quiet_ms) < 2:
        return None
    rng = np.random.default_rng(seed)
    loaded, quiet = np.asarray(loaded_ms, float), np.asarray(quiet_ms, float)
    top = np.percentile(rng.choice(loaded, (resamples, loaded.size)), q, axis=1)
    bottom = np.percentile(rng.choice(quiet, (resamples, quiet.size)), q, axis=1)
    lo, hi = np.percentile(top / bottom, [2.5, 97.5])
    return [round(float(lo), 2), round(float(hi), 2)]


def _probe(port: int, victim: str, probes: int, probe_tokens: int, seconds: float) -> tuple[list, list, Counter]:
    """The victim's single requests one after another: (latencies ms, their parts, errors by kind)."""
    from serve.rpc import Client, ServerError

    latencies, parts, errors = [], [], Counter()
    end = time.monotonic() + seconds
    with Client("127.0.0.1", port, victim) as client:
        while len(latencies) < probes and time.monotonic() < end:
            start = time.perf_counter()
            try:
                stream = client.submit_image("How many cars?", [FRAME], sampling={
                    "max_tokens": probe_tokens, "ignore_eos": True})
                submitted = time.perf_counter()
                final = stream.result(max(5.0, end - time.monotonic() + 30))
                latencies.append((time.perf_counter() - start) * 1e3)
                parts.append(_parts(latencies[-1], (submitted - start) * 1e3, final.get("timing") or {}))
            except (ServerError, TimeoutError) as e:
                errors[getattr(e, "kind", type(e).__name__)] += 1
    return latencies, parts, errors


def _engine_counts(port: int, token: str) -> dict:
    """The engine's waits for a tenant about to come back so far (serve/engine/anticipation.py; {} when off),
    its process's garbage collections by generation (serve/engine/garbage.py), flattened, and its quiet
    steps (serve/engine/tenancy.py step_caps)."""
    from serve.rpc import Client

    with Client("127.0.0.1", port, token) as client:
        engine = client.metrics()["engine"]
    gc = {f"{gen}_{part}": v for gen, row in (engine.get("gc") or {}).items() for part, v in row.items()}
    return {"anticipation": engine.get("anticipation") or {}, "gc": gc, "quiet_steps": engine.get("quiet_steps", 0)}


def _gate_counts(port: int, tokens: dict) -> dict:
    """who -> that tenant's turns at the server's gate so far (calls, calls that queued, pacing sleeps and
    ms; serve/rpc/gate.py), each read with its own token (a tenant sees only its own). A tenant process
    reports its counts about once a second, so a count can land up to a second late."""
    from serve.rpc import Client

    out = {}
    for who, token in tokens.items():
        try:
            with Client("127.0.0.1", port, token) as client:
                out[who] = next(iter(client.metrics().get("gate", {}).values()), {})
        except Exception:  # a token the server refuses (a test's unknown attacker): nothing to count
            out[who] = {}
    return out


def _since(now: dict, before: dict) -> dict:
    return {k: round(v - before.get(k, 0), 3) for k, v in now.items() if not k.endswith("max_ms")}


def flood_phases(port: int, attacker: str, victim: str, names, seconds: float, probes: int, probe_tokens: int,
                 unloaded_p95_ms: float, max_ratio: float, client_nice: int = 0, http_port: int | None = None,
                 server_pid: int | None = None) -> dict:
    """One phase per flood in `names`, one after another; each returns the victim's latency and ratio.

    Right before each flood the victim's probes run alone (`quiet`): the ratio is the flood's p95
    over that p95, measured under the same conditions of the machine. On a machine shared with other
    work the soak's baseline, minutes earlier, can sit at half or twice the floor of the moment
    (12 vs 24 ms p95 in two runs three minutes apart on 2 shared cores); `ratio_to_baseline` keeps
    the ratio to it as well. `client_nice`: the flood's client process runs at this niceness; on a
    machine of few cores that also runs the server, a positive value stands for an attacker whose
    client threads run on machines of its own, so its own CPU use is not charged to the server.
    `http_port`: the server's HTTP port, for the floods of HTTP_FLOODS (the victim stays on RPyC).
    `server_pid`: the server's process, whose tree's CPU is told apart from the rest (`cpu`, `cpu_quiet`).

    Each flood's probes alone right after it (`quiet_after`: the next flood's `quiet`, or one more window
    after the last) are reported beside it, with `drift`, their p95 over the one before, and
    `ratio_to_quiet_after`. The check stays the ratio to the window before. On a GPU host whose speed moves
    by itself, the two windows around a flood say how far the machine moved while it ran."""
    out: dict = {}
    server = [server_pid] if server_pid else []
    for name in names:
        window = CpuWindow({"server": server, "soak": [os.getpid()]}).start()
        quiet_latencies, quiet_parts, _ = _probe(port, victim, probes, probe_tokens, seconds)
        cpu_quiet = window.stop()
        quiet = latency_summary(quiet_latencies) if quiet_latencies else None
        counts_before = _engine_counts(port, victim)
        whose = {"victim": victim} if name in OWN_FLOODS else {"victim": victim, "attacker": attacker}
        gate_before = _gate_counts(port, whose)
        if name in HTTP_FLOODS and http_port is None:
            raise ValueError(f"flood {name!r} needs the server's HTTP port (http.port)")
        target_port = http_port if name in HTTP_FLOODS else port
        flooder = victim if name in OWN_FLOODS else attacker
        proc = FloodProcess(target_port, flooder, name, client_nice).start()
        latencies, parts, errors, cpu = [], [], Counter(), None
        try:
            proc.wait_ready(60)
            time.sleep(min(2.0, seconds / 4))  # the flood's queues fill first
            window = CpuWindow({"server": server, "flood": [proc.pid], "soak": [os.getpid()]}).start()
            latencies, parts, errors = _probe(port, victim, probes, probe_tokens, seconds)
            cpu = window.stop()
        finally:
            flood = proc.stop()
        counts = _engine_counts(port, victim)
        probe = latency_summary(latencies) if latencies else None
        reference = quiet["p95_ms"] if quiet is not None else unloaded_p95_ms
        ratio = None if probe is None else round(probe["p95_ms"] / reference, 2)
        interval = ratio_interval(latencies, quiet_latencies) if quiet is not None else None
        out[name] = {"actions": sum(v for k, v in flood.items() if k in ("submitted", "calls")) + len(latencies),
                     "flood": flood, "probe": probe, "victim_errors": dict(errors), "quiet": quiet,
                     "unloaded_p95_ms": unloaded_p95_ms, "ratio": ratio, "ratio_interval": interval,
                     "max_ratio": max_ratio,
                     "ratio_to_baseline": None if probe is None else round(probe["p95_ms"] / unloaded_p95_ms, 2),
                     # the engine's waits for a tenant about to come back, and its process's garbage
                     # collections (counts, ms; the longest so far), during the flood
                     "anticipation": _since(counts["anticipation"], counts_before["anticipation"]),
                     "quiet_steps": counts["quiet_steps"] - counts_before["quiet_steps"],
                     "gc": {**_since(counts["gc"], counts_before["gc"]),
                            **{k: v for k, v in counts["gc"].items() if k.endswith("max_ms")}},
                     "where": where_the_time_goes(parts), "where_quiet": where_the_time_goes(quiet_parts),
                     # the machine's cores while the probes ran, by whose processes (bench/soak_cpu.py)
                     "cpu": cpu, "cpu_quiet": cpu_quiet,
                     # each probe's parts, in the order sent (the tail's causes, probe by probe)
                     "probes": [_rounded(p) for p in parts], "quiet_probes": [_rounded(p) for p in quiet_parts],
                     "ok": ratio is not None and not errors and ratio <= max_ratio}
        time.sleep(1.2)  # what the flood left queued drains (its connections closed: aborted); the counts report
        # each tenant's calls under the flood: how many, how many queued for a slot, how often and how long
        # paced (a victim paced while the flood is held to its part shows here)
        out[name]["gate"] = {who: _since(now, gate_before[who]) for who, now in _gate_counts(port, whose).items()}
    if out:
        closing, _, _ = _probe(port, victim, probes, probe_tokens, seconds)
        _quiet_after(out, latency_summary(closing) if closing else None)
    return out


def _quiet_after(out: dict, closing: dict | None) -> None:
    """Each flood's window alone after it, in the order they ran: the next one's `quiet`, the last's
    `closing`; with its p95 over the window before (`drift`) and the flood's p95 over it."""
    floods = list(out.values())
    for f, after in zip(floods, [g["quiet"] for g in floods[1:]] + [closing]):
        before, probe = f["quiet"], f["probe"]
        f["quiet_after"] = after
        f["drift"] = round(after["p95_ms"] / before["p95_ms"], 2) if after and before else None
        f["ratio_to_quiet_after"] = round(probe["p95_ms"] / after["p95_ms"], 2) if after and probe else None
