"""`python -m bench.engine_pipe`: the engine process's events reaching a front end whose threads are busy.

The engine process (serve/rpc/engine_host.py) sends its loop's events over one pipe; the front end's router
thread reads them while the connection threads run Python. Each read gives up the interpreter, and a
busy thread keeps it for up to the switch interval (5 ms) before the router gets it back, so events read
one per write cross at a few hundred a second while clients keep the front end busy. This times N events
(in steps of `--step` with a pause between, as a step loop sends them) from a spawned sender process to
this process, where `--busy` threads spin, read one per write (the old framing) and in the batched writes
of `_send_all`, alternating, `--repeats` times each. Writes `engine_pipe.json` to `--out`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import platform
import queue
import statistics
import threading
import time
from pathlib import Path

from serve.rpc.engine_host import _send_all, dumps, receive_all


def _one_per_write(conn, outbox) -> None:
    while (message := outbox.get()) is not None:
        conn.send_bytes(dumps(message))


def _sender(conn, events: int, step: int, pause_s: float, batched: bool) -> None:
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    thread = threading.Thread(target=_send_all if batched else _one_per_write, args=(conn, outbox))
    thread.start()
    outbox.put(("ready", {}))
    for i in range(events):
        outbox.put(("event", f"r{i % step}", {"type": "token", "token_id": i, "text": "ab"}))
        if i % step == step - 1:
            time.sleep(pause_s)
    outbox.put(None)
    thread.join()


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(200))


def one_run(events: int, busy: int, step: int, pause_s: float, batched: bool) -> float:
    """Seconds from the first message read to the last, with `busy` threads spinning here."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    stop = threading.Event()
    spinners = [threading.Thread(target=_spin, args=(stop,)) for _ in range(busy)]
    for t in spinners:
        t.start()
    sender = ctx.Process(target=_sender, args=(there, events, step, pause_s, batched))
    sender.start()
    try:
        got, start = 0, None
        while got < events + 1:
            messages = receive_all(here) if batched else [pickle.loads(here.recv_bytes())]
            start = start or time.perf_counter()
            got += len(messages)
        return time.perf_counter() - start
    finally:
        stop.set()
        for t in spinners:
            t.join()
        sender.join(10)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.engine_pipe", description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=2000)
    p.add_argument("--busy", type=int, nargs="+", default=[1, 4])
    p.add_argument("--step", type=int, default=256, help="events a step sends together")
    p.add_argument("--pause-ms", type=float, default=2.0, help="between steps")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="results/engine_pipe")
    a = p.parse_args(argv)
    rows = []
    for busy in a.busy:
        times: dict[str, list[float]] = {"one_per_write": [], "batched": []}
        for _ in range(a.repeats):
            for batched in (False, True):
                times["batched" if batched else "one_per_write"].append(
                    one_run(a.events, busy, a.step, a.pause_ms / 1e3, batched))
        row = {"busy_threads": busy, "events": a.events, **{f"{k}_s": v for k, v in times.items()},
               **{f"{k}_events_per_s": a.events / statistics.median(v) for k, v in times.items()}}
        rows.append(row)
        print(f"[engine_pipe] {busy} busy threads: one per write {row['one_per_write_events_per_s']:.0f} events/s, "
              f"batched {row['batched_events_per_s']:.0f} events/s", flush=True)
    result = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
                       "cpus": multiprocessing.cpu_count(), "args": vars(a)}, "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_pipe.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
