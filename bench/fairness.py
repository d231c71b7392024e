"""A victim's request latency while other clients flood the server (issue 44, class 6).

    python -m bench.fairness                                   # every flood, 15 s each
    python -m bench.fairness --floods unloaded,poll32 --seconds 10 --repeat 2

A real `vlora serve` subprocess on loopback (the tiny zoo model on CPU unless --checkpoint). The
victim is one connection in this process sending single requests one after another (a 32x32
image, --probe-tokens out) and timing each; the flood runs in a separate process (its own
interpreter, as a real client's would be), one thread per connection. Floods:

  unloaded     nothing else
  flood256     one connection keeping 256 requests of 200 tokens queued
  topup4       4 connections each keeping 64 one-token requests queued (collecting them at once)
  queued2048   8 connections each keeping 256 one-token requests queued
  topup32      32 connections each keeping 16 one-token requests queued
  poll32       32 connections calling poll(unknown id) in a loop: no engine work at all
  health32     32 connections calling health() in a loop
  polite8      8 connections each sending requests like the victim's, one after another (no flood:
               clients whose polls wait server-side for their events)

Prints a table (victim p50/p95 per flood and the ratio to the unloaded p95) and writes
fairness.csv / fairness.json under --out/<device>.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.soak_server import ServerUnderTest, latency_summary

FRAME = np.zeros((32, 32, 3), np.uint8)
# name -> (connections, kind, queued per connection, tokens per request)
FLOODS = {
    "unloaded": (0, "none", 0, 0),
    "flood256": (1, "topup", 256, 200),
    "topup4": (4, "topup", 64, 1),
    "queued2048": (8, "topup", 256, 1),
    "topup32": (32, "topup", 16, 1),
    "poll32": (32, "poll", 0, 0),
    "health32": (32, "health", 0, 0),
    "polite8": (8, "serial", 0, 2),
}


def _attacker(port: int, token: str, kind: str, depth: int, tokens: int, stop, counts) -> None:
    """One flooding connection: runs until `stop`; adds its call count to `counts`."""
    from serve.rpc import Client, ServerError

    calls = 0
    try:
        with Client("127.0.0.1", port, token) as client:
            pending = []
            while not stop.is_set():
                if kind == "poll":
                    try:
                        client._call("poll", "no-such-request", 0.0)
                    except ServerError:
                        pass
                elif kind == "health":
                    client.health()
                elif kind == "serial":
                    client.submit_image("Describe.", [FRAME], sampling={"max_tokens": tokens, "ignore_eos": True}
                                        ).result(60.0)
                else:  # keep `depth` requests queued; collect the finished ones without waiting
                    while len(pending) < depth and not stop.is_set():
                        try:
                            pending.append(client.submit_image("Describe.", [FRAME], sampling={
                                "max_tokens": tokens, "ignore_eos": True}))
                        except ServerError:  # a limit of the server: poll what is queued first
                            break
                        calls += 1
                    for s in list(pending):
                        try:
                            s.poll(0.0)
                        except ServerError:
                            pending.remove(s)
                            continue
                        calls += 1
                        if s.final is not None:
                            pending.remove(s)
                calls += kind in ("poll", "health", "serial")
    except (EOFError, ConnectionError, OSError):
        pass  # the server closed us (a limit) or is going away: the flood ends here
    with counts.get_lock():
        counts.value += calls


def _flood_process(port: int, token: str, name: str, stop, counts) -> None:
    connections, kind, depth, tokens = FLOODS[name]
    threads = [threading.Thread(target=_attacker, args=(port, token, kind, depth, tokens, stop, counts), daemon=True)
               for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def victim_latencies(port: int, token: str, seconds: float, probes: int, probe_tokens: int) -> list[float]:
    """Latencies (ms) of up to `probes` sequential requests within `seconds`."""
    from serve.rpc import Client

    out = []
    end = time.monotonic() + seconds
    with Client("127.0.0.1", port, token) as client:
        while len(out) < probes and time.monotonic() < end:
            start = time.perf_counter()
            client.submit_image("How many cars?", [FRAME], sampling={"max_tokens": probe_tokens, "ignore_eos": True}
                                ).result(max(5.0, end - time.monotonic() + 60.0))
            out.append((time.perf_counter() - start) * 1e3)
    return out


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_flood(port: int, token: str, flood_token: str, name: str, seconds: float, probes: int, probe_tokens: int,
              warmup_s: float, server_pid: int) -> dict:
    ctx = mp.get_context("fork")  # this process holds no torch: the client side only
    stop, counts = ctx.Event(), ctx.Value("q", 0)
    proc = None
    if FLOODS[name][0]:
        proc = ctx.Process(target=_flood_process, args=(port, flood_token, name, stop, counts), daemon=True)
        proc.start()
        time.sleep(warmup_s)  # the flood's queues fill first
    cpu, start = _cpu_s(server_pid), time.monotonic()
    try:
        latencies = victim_latencies(port, token, seconds, probes, probe_tokens)
        server_cpu = (_cpu_s(server_pid) - cpu) / (time.monotonic() - start)
    finally:
        stop.set()
        if proc is not None:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    row = {"flood": name, **latency_summary(latencies), "flood_calls": counts.value,
           "server_cores": round(server_cpu, 2)}
    time.sleep(1.0)  # what the flood left queued is aborted as its connections close
    return row


def _write_tenants(path: Path, tokens: dict[str, str], flood_quotas: dict) -> None:
    """A tenants file (serve.rpc.tenants) with room for every flood: quotas above what the floods hold
    (the flood tenant's own `flood_quotas` over them)."""
    import json

    from serve.rpc.tenants import token_hash

    quotas = {"connections": 64, "queued": 4096}
    doc = {"tenants": {}, "quotas": quotas}
    names_of: dict[str, list[str]] = {}
    for name, token in tokens.items():  # one token for both (--one-tenant): one tenant "victim-flood"
        names_of.setdefault(token, []).append(name)
    for token, names in names_of.items():
        doc["tenants"]["-".join(names)] = {"role": "tenant", "token_sha256": token_hash(token)}
        if names == ["flood"] and flood_quotas:
            doc["tenants"]["flood"]["quotas"] = {**quotas, **flood_quotas}
    path.write_text(json.dumps(doc))


def _uptime_load() -> float:
    return os.getloadavg()[0]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--floods", default=",".join(FLOODS), help=f"comma-separated, of {list(FLOODS)}")
    p.add_argument("--seconds", type=float, default=15.0, help="victim's measuring time per flood")
    p.add_argument("--probes", type=int, default=40, help="victim requests per flood (at most)")
    p.add_argument("--probe-tokens", type=int, default=2)
    p.add_argument("--warmup-s", type=float, default=2.0, help="flood alone before the victim starts")
    p.add_argument("--repeat", type=int, default=1, help="runs of the whole list (to see the noise)")
    p.add_argument("--checkpoint", default=None, help="an HF directory; default: the tiny zoo qwen2_vl_tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--server-threads", type=int, default=1, help="the server's OpenMP threads")
    p.add_argument("--one-tenant", action="store_true", help="the flood uses the victim's token (one tenant)")
    p.add_argument("--flood-in-flight", type=int, default=None,
                   help="the flood tenant's in_flight quota: its requests running in the engine's batch at once")
    p.add_argument("--out", default="results/fairness")
    p.add_argument("overrides", nargs="*", help="extra `vlora serve` overrides (key=value)")
    args = p.parse_args(argv)
    names = [n for n in args.floods.split(",") if n]
    unknown = [n for n in names if n not in FLOODS]
    if unknown:
        raise SystemExit(f"--floods: {unknown} are not floods; choose from {list(FLOODS)}")

    home = Path(tempfile.mkdtemp(prefix="vlora-fairness-"))
    token, flood_token = secrets.token_hex(16), secrets.token_hex(16)
    if args.one_tenant:
        flood_token = token
    _write_tenants(home / "tenants.json", {"victim": token, "flood": flood_token},
                   {"in_flight": args.flood_in_flight} if args.flood_in_flight else {})
    checkpoint = args.checkpoint
    if checkpoint is None:
        from zoo import build_checkpoint

        checkpoint = str(build_checkpoint("qwen2_vl_tiny", home / "zoo" / "qwen2_vl_tiny"))
    overrides = ["+engine.num_kv_blocks=2048", "rpc.max_connections=128", f"++rpc.tenants={home / 'tenants.json'}",
                 *args.overrides]
    server = ServerUnderTest(checkpoint, home, token, args.device, overrides, args.server_threads)
    rows = []
    try:
        victim_latencies(server.port, token, 30.0, 5, args.probe_tokens)  # warm-up, not measured
        for rep in range(args.repeat):
            for name in names:
                load = _uptime_load()
                row = run_flood(server.port, token, flood_token, name, args.seconds, args.probes, args.probe_tokens,
                                args.warmup_s, server.proc.pid)
                row.update(run=rep, load_before=round(load, 2), server_alive=server.alive())
                rows.append(row)
                print(f"fairness: {name:<11} p50 {row['p50_ms']:>8.1f} ms  p95 {row['p95_ms']:>8.1f} ms  "
                      f"n={row['n']} flood_calls={row['flood_calls']} server_cores={row['server_cores']} load={load:.2f}", file=sys.stderr, flush=True)
                if not server.alive():
                    raise RuntimeError("the server died:\n" + server.log_tail())
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)
    _report(rows, args)
    return rows


def _report(rows: list[dict], args) -> None:
    from bench.results import results_dir, write_csv, write_json

    unloaded = [r["p95_ms"] for r in rows if r["flood"] == "unloaded"]
    base = min(unloaded) if unloaded else None
    for r in rows:
        r["ratio_p95"] = round(r["p95_ms"] / base, 2) if base else None
    print(f"\n{'flood':<11} {'run':>3} {'n':>4} {'p50 ms':>9} {'p95 ms':>9} {'max ms':>9} {'p95/unloaded':>13}")
    for r in rows:
        print(f"{r['flood']:<11} {r['run']:>3} {r['n']:>4} {r['p50_ms']:>9.1f} {r['p95_ms']:>9.1f} {r['max_ms']:>9.1f} "
              f"{r['ratio_p95'] if r['ratio_p95'] is not None else '-':>13}")
    out = results_dir(args.out, "cpu" if args.device == "cpu" else args.device)
    command = "python -m bench.fairness " + " ".join(sys.argv[1:])
    write_csv(out / "fairness.csv", rows)
    write_json(out / "fairness.json", {"command": command, "cores": os.cpu_count(), "rows": rows,
                                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})


if __name__ == "__main__":
    main()
