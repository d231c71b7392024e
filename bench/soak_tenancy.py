"""The soak's phases for a server shared by tenants: a pre-auth lockout from one address (at the RPyC
port, and at the HTTP port when the server has one), numbers
that once made the engine raise, one tenant reaching for another's adapters, replies that amplify
what was sent, and frames that take long to decode.

Each phase is bounded by its time and count, talks to loopback only, and returns what it did, what
it measured and whether the server held (`ok`).
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections import Counter

import numpy as np

from bench.soak_server import latency_summary

FRAME = np.zeros((32, 32, 3), np.uint8)
DROPPED = (EOFError, ConnectionError, OSError)


def _served_s(port: int, token: str, host: str, max_tokens: int = 2) -> float:
    """Seconds from connect (from source address `host`) to one request answered."""
    start = time.perf_counter()
    client = _client_from(port, token, host)
    try:
        client.submit_image("How many cars?", [FRAME], sampling={"max_tokens": max_tokens, "ignore_eos": True}).result(30)
    finally:
        client.close()
    return time.perf_counter() - start


def _client_from(port: int, token: str, host: str):
    """A Client whose socket leaves from loopback address `host` (127.0.0.x)."""
    from serve.rpc import Client

    return Client("127.0.0.1", port, token, reconnect=False, source=host)


def _http(port: int, token: str, host: str, method: str, path: str, body: dict | None = None) -> dict:
    """One HTTP request on a new connection from source address `host`; its JSON reply (not 200: raises)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(host, 0))
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        reply = conn.getresponse()
        text = reply.read()
        if reply.status != 200:
            raise ConnectionError(f"HTTP {reply.status}: {text[:200]!r}")
        return json.loads(text)
    finally:
        conn.close()


def http_lockout_phase(http_port: int, token: str, seconds: float, sockets: int, probes: int, max_s: float) -> dict:
    """The lockout at the HTTP port: idle sockets and heads that trickle a byte now and then, from
    127.0.0.2, while a client from 127.0.0.3 connects and has a chat completion answered."""
    model = _http(http_port, token, "127.0.0.3", "GET", "/v1/models")["data"][0]["id"]  # the base model
    body = {"model": model, "max_tokens": 2, "ignore_eos": True,
            "messages": [{"role": "user", "content": "How many cars?"}]}

    def served_s(port: int, token: str, host: str) -> float:
        start = time.perf_counter()
        _http(port, token, host, "POST", "/v1/chat/completions", body)
        return time.perf_counter() - start

    return lockout_phase(http_port, token, seconds, sockets, probes, max_s, served_s=served_s, trickle=b"G")


def lockout_phase(port: int, token: str, seconds: float, sockets: int, probes: int, max_s: float,
                  served_s=_served_s, trickle: bytes = b"V") -> dict:
    """`sockets` idle and trickling unauthenticated sockets from 127.0.0.2, reopened as soon as the server
    drops them, while a client from 127.0.0.3 connects and is served `probes` times (`served_s`: one
    such client's connect-to-answer, in seconds; `trickle`: the byte the trickling half sends)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < sockets + 256 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (sockets + 256, hard))
    stop, stats, live = threading.Event(), Counter(), []

    def flood() -> None:
        last = 0.0
        while not stop.is_set():
            while len(live) < sockets and not stop.is_set():
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=2, source_address=("127.0.0.2", 0))
                    if len(live) % 2:
                        s.send(trickle)  # the trickling half: a byte now and then, never a whole line or head
                    s.setblocking(False)
                    live.append(s)
                    stats["opened"] += 1
                except OSError:
                    stats["connect_failed"] += 1
                    break
            now = time.monotonic()
            for s in list(live):
                try:
                    if s.recv(1) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    if now - last > 0.5 and live.index(s) % 2:
                        try:
                            s.send(trickle)
                        except OSError:
                            pass
                    continue
                except OSError:
                    pass
                stats["dropped_by_server"] += 1
                live.remove(s)
                s.close()
            last = now if now - last > 0.5 else last
            time.sleep(0.05)

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    served, failed = [], Counter()
    end = time.monotonic() + seconds
    try:
        time.sleep(min(3.0, seconds / 3))  # the flood is in place first
        while len(served) + sum(failed.values()) < probes and time.monotonic() < end:
            try:
                served.append(served_s(port, token, "127.0.0.3"))
            except Exception as e:  # refused or timed out: the lockout this phase looks for
                failed[type(e).__name__] += 1
            time.sleep(0.2)
    finally:
        stop.set()
        thread.join(10)
        for s in live:
            s.close()
    worst = max(served, default=None)
    return {"actions": stats["opened"] + len(served), "flood": dict(stats), "probes_failed": dict(failed),
            "served_s": [round(s, 3) for s in served], "worst_s": None if worst is None else round(worst, 3),
            "max_s": max_s, "ok": not failed and bool(served) and worst <= max_s}


def _spec(**fields) -> str:
    raw = {"format": "raw", "shape": [32, 32, 3], "dtype": "uint8"}
    return json.dumps({"prompt": "Describe.", "frames": [raw], **fields})


BAD_NUMBERS = [{"slo_ms": 5e-324}, {"slo_ms": 1e-300}, {"slo_ms": 1e308}, {"sampling": {"max_tokens": 2, "seed": 2**70}},
               {"sampling": {"max_tokens": 2, "temperature": 1e308}}, {"sampling": {"max_tokens": 2, "top_k": 2**62}},
               {"sampling": {"max_tokens": 2, "top_p": 5e-324, "temperature": 1.0}},
               {"sampling": {"max_tokens": 2, "stop_token_ids": [2**62]}}]


def numbers_phase(port: int, attacker: str, victim: str, seconds: float, victim_tokens: int) -> dict:
    """Every 0.3 s the attacker sends a request with an extreme number; meanwhile the victim runs
    requests of `victim_tokens` tokens one after another. The victim's requests must finish with at
    most one restart each, and the engine must fail no step."""
    from serve.rpc import Client, ServerError

    stop, outcomes = threading.Event(), Counter()

    def attack() -> None:
        with Client("127.0.0.1", port, attacker) as client:
            i = 0
            while not stop.is_set():
                fields = dict(BAD_NUMBERS[i % len(BAD_NUMBERS)])
                fields.setdefault("sampling", {"max_tokens": 2})
                try:
                    rid = json.loads(client._conn.root.submit_image(_spec(**fields), (bytes(32 * 32 * 3),)))
                    outcomes["accepted" if rid.get("ok") else f"refused_{rid['error']['type']}"] += 1
                except DROPPED:
                    outcomes["connection_failed"] += 1
                    return
                i += 1
                stop.wait(0.3)

    with Client("127.0.0.1", port, victim) as probe:
        before = probe.metrics()["server"]
    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    restarts, latencies, errors = [], [], Counter()
    end = time.monotonic() + seconds
    try:
        with Client("127.0.0.1", port, victim) as client:
            while time.monotonic() < end:
                start = time.perf_counter()
                stream = client.submit_image("Describe.", [FRAME], sampling={"max_tokens": victim_tokens,
                                                                              "ignore_eos": True})
                n = 0
                try:
                    for event in stream:
                        n += event["type"] == "restart"
                except ServerError as e:
                    errors[e.kind] += 1
                restarts.append(n)
                latencies.append((time.perf_counter() - start) * 1e3)
    finally:
        stop.set()
        thread.join(10)
    with Client("127.0.0.1", port, victim) as probe:
        after = probe.metrics()["server"]
    step_errors = after.get("engine_step_errors", 0) - before.get("engine_step_errors", 0)
    return {"actions": sum(outcomes.values()) + len(latencies), "attacker": dict(outcomes),
            "victim": latency_summary(latencies) if latencies else None, "victim_errors": dict(errors),
            "most_restarts": max(restarts, default=None), "step_errors": step_errors,
            "ok": bool(latencies) and not errors and max(restarts) <= 1 and step_errors == 0}


def _refused(call) -> str:
    """`call()`'s error kind, or 'ALLOWED' when it went through."""
    from serve.rpc import ServerError

    try:
        call()
    except ServerError as e:
        return e.kind
    return "ALLOWED"


def boundary_phase(port: int, operator: str, victim: str, attacker: str, adapter_root: str) -> dict:
    """The victim loads an adapter; the attacker tries to see, use, unload, replace or read it, and to
    unload the operator's; every reply is searched for server paths."""
    from serve.rpc import Client

    tries: dict[str, str] = {}
    with Client("127.0.0.1", port, victim) as v, Client("127.0.0.1", port, attacker) as a, \
            Client("127.0.0.1", port, operator) as ops:
        ops.load_adapter("shared_soak", "shared")
        v.load_adapter("plates", "plates")
        seen = json.dumps(a.list_adapters()) + json.dumps(v.list_adapters()) + json.dumps(ops.list_adapters())
        tries["attacker_lists_victims"] = "ALLOWED" if "plates" in json.dumps(a.list_adapters()) else "hidden"
        tries["attacker_uses_victims"] = _refused(lambda: a.submit_image("Describe.", [FRAME], adapter="plates").result(30))
        tries["attacker_unloads_victims"] = _refused(lambda: a.unload_adapter("plates"))
        tries["attacker_spells_owner"] = _refused(lambda: a.unload_adapter("plates@victim"))
        tries["attacker_unloads_shared"] = _refused(lambda: a.unload_adapter("shared_soak"))
        tries["attacker_reads_victims_folder"] = _refused(lambda: a.load_adapter("x", "../victim/plates"))
        tries["attacker_reads_root"] = _refused(lambda: a.load_adapter("x", "/"))
        before = v.submit_image("Describe.", [FRAME], adapter="plates",
                                sampling={"max_tokens": 4, "ignore_eos": True}).result(30)["token_ids"]
        tries["attacker_loads_same_name"] = _refused(lambda: a.load_adapter("plates", "other"))  # its own namespace
        after = v.submit_image("Describe.", [FRAME], adapter="plates",
                               sampling={"max_tokens": 4, "ignore_eos": True}).result(30)["token_ids"]
        leaked = adapter_root in seen or "/tmp" in seen
        if tries["attacker_loads_same_name"] == "ALLOWED":
            a.unload_adapter("plates")
        v.unload_adapter("plates")
        ops.unload_adapter("shared_soak")
    held = all(tries[k] != "ALLOWED" for k in tries if k != "attacker_loads_same_name") and \
        tries["attacker_lists_victims"] == "hidden"
    return {"actions": len(tries), "tries": tries, "victim_answer_unchanged": before == after,
            "paths_in_replies": leaked, "ok": held and before == after and not leaked}


def amplify_phase(port: int, token: str, connections: int, arg_bytes: int) -> dict:
    """Each connection sends a string of `arg_bytes` as poll's request id and as metrics' format; the
    largest reply must stay small whatever was sent."""
    from serve.rpc import Client

    largest, outcomes = 0, Counter()
    junk = "x" * arg_bytes

    def one() -> None:
        nonlocal largest
        try:
            with Client("127.0.0.1", port, token, reconnect=False) as client:
                for method, args in (("poll", (junk, 0.0)), ("metrics", (junk,)), ("abort", (junk,))):
                    text = getattr(client._conn.root, method)(*args)
                    largest = max(largest, len(text))
                    outcomes[json.loads(text).get("error", {}).get("type", "ok")] += 1
        except DROPPED:
            outcomes["closed"] += 1

    threads = [threading.Thread(target=one, daemon=True) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return {"actions": connections * 3, "outcomes": dict(outcomes), "largest_reply_bytes": largest,
            "argument_bytes": arg_bytes, "ok": largest < 4096 and outcomes["internal"] == 0}


def scan_bomb(width: int = 3840, height: int = 2160, scans: int = 20000) -> bytes:
    """A progressive JPEG whose last scan is repeated `scans` times: small on the wire, slow to decode."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 30)).save(buf, format="JPEG", progressive=True, quality=50)
    data = buf.getvalue()
    last_sos = data.rfind(b"\xff\xda")
    scan = data[last_sos:-2]  # the last scan (header + entropy-coded data), without the end-of-image marker
    return data[:-2] + scan * scans + b"\xff\xd9"


def decode_phase(port: int, attacker: str, victim: str, seconds: float, connections: int, frames: int) -> dict:
    """`connections` attacker connections send requests of `frames` scan-bomb frames in a loop while
    the victim sends real chunks; each refusal is timed."""
    from serve.rpc import Client, ServerError

    bomb = scan_bomb()
    spec = json.dumps({"prompt": "Describe.", "frames": [{"format": "encoded"}] * frames,
                       "sampling": {"max_tokens": 2}})
    stop, outcomes, refusal_s = threading.Event(), Counter(), []

    def attack() -> None:
        try:
            with Client("127.0.0.1", port, attacker, reconnect=False) as client:
                while not stop.is_set():
                    start = time.perf_counter()
                    reply = json.loads(client._conn.root.submit_video(spec, (bomb,) * frames))
                    refusal_s.append(time.perf_counter() - start)
                    outcomes["accepted" if reply["ok"] else reply["error"]["type"]] += 1
                    if reply["ok"]:
                        client._conn.root.abort(reply["request_id"])
        except DROPPED:
            outcomes["closed"] += 1

    threads = [threading.Thread(target=attack, daemon=True) for _ in range(connections)]
    for t in threads:
        t.start()
    latencies, errors = [], Counter()
    end = time.monotonic() + seconds
    try:
        time.sleep(min(1.0, seconds / 4))
        with Client("127.0.0.1", port, victim) as client:
            while time.monotonic() < end:
                start = time.perf_counter()
                try:
                    client.submit_video("Describe.", [FRAME] * 4, sampling={"max_tokens": 2, "ignore_eos": True}).result(60)
                    latencies.append((time.perf_counter() - start) * 1e3)
                except ServerError as e:
                    errors[e.kind] += 1
                time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    worst = max(refusal_s, default=None)
    return {"actions": sum(outcomes.values()) + len(latencies), "attacker": dict(outcomes),
            "bomb_bytes": len(bomb), "slowest_answer_s": None if worst is None else round(worst, 3),
            "victim": latency_summary(latencies) if latencies else None, "victim_errors": dict(errors),
            "ok": bool(latencies) and not errors and outcomes["accepted"] == 0 and (worst or 0) < 2.0}
