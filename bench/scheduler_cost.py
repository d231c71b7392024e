"""Host time of a step's planning against the length of the waiting queue (no model, no device).

One tenant keeps QUEUE one-token requests of 40 prompt tokens waiting over 8 connections (the soak's
`queue2048` flood at 2,048), another sends one request at a time; each step the orchestrator plans (with
`--policy` other than fcfs) and the scheduler schedules, and the finished requests are replaced. The time of
plan + schedule is what every step of the engine's loop spends on the host before the device gets work, so
it is what a victim's request waits for on top of its own.

    python -m bench.scheduler_cost --queues 8 64 256 2048 --windows 64 none --out results/scheduler/cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import Counter
from pathlib import Path

from serve.engine.block_manager import BlockManager
from serve.engine.planner import StepPlanner
from serve.engine.scheduler import FairShare, Scheduler, SchedulerConfig
from serve.engine.sequence import Sequence
from serve.orchestrator import assumed_profile, build_policy


def _window(text: str) -> int | None:
    return None if text.lower() in ("none", "null") else int(text)


def measure(queue: int, window: int | None, policy: str, steps: int, batch: int = 8) -> dict:
    sched = Scheduler(SchedulerConfig(max_batch_size=batch, max_tokens_per_step=2048, max_model_len=4096,
                                      waiting_window=window), BlockManager(4096, 16), FairShare())
    planner = None
    if policy != "fcfs":
        planner = StepPlanner(build_policy(policy, assumed_profile(), {}), sched, None, batch, 2048,
                              request_info=lambda rid: (None, None, 1.0))
    made = Counter()

    def request(tenant: str, owner: str) -> Sequence:
        made[tenant] += 1
        base = 100 * sum(made.values())
        return Sequence(f"{tenant}-{made[tenant]}", list(range(base, base + 40)), 1,
                        arrival_time=time.perf_counter(), owner=owner, tenant=tenant)

    for i in range(queue):
        sched.add(request("flood", f"c{i % 8}"))
    sched.add(request("victim", "v"))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        batch = sched.schedule(planner.plan() if planner is not None else None)
        times.append((time.perf_counter() - start) * 1e3)
        sched.postprocess(batch, {q.seq_id: 7 for q, n in batch.entries if q.num_computed_tokens + n == q.num_tokens})
        for q, _ in batch.entries:
            if q.is_finished:  # the flood tops its queue up; the victim sends its next request
                sched.add(request(q.tenant, q.owner))
    times.sort()
    return {"queue": queue, "window": window, "policy": policy, "steps": steps,
            "median_ms": round(statistics.median(times), 3), "p95_ms": round(times[int(0.95 * (len(times) - 1))], 3),
            "looked_at": len(sched.waiting), "backlog": sched.num_backlogged}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queues", type=int, nargs="+", default=[8, 64, 256, 2048])
    ap.add_argument("--windows", type=_window, nargs="+", default=[64, None], help="integers, or none (no window)")
    ap.add_argument("--policies", nargs="+", default=["fcfs", "v_lora"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None, help="a folder for scheduler_cost.json and .md")
    args = ap.parse_args(argv)
    if min(args.queues) < 0 or args.steps < 1:
        ap.error("--queues must be >= 0 and --steps >= 1")
    rows = []
    for policy in args.policies:
        for queue in args.queues:
            for window in args.windows:
                rows.append(measure(queue, window, policy, args.steps))
                r = rows[-1]
                print(f"{policy:7s} queue {queue:5d} window {str(window):>4s}: plan + schedule median "
                      f"{r['median_ms']:.3f} ms, p95 {r['p95_ms']:.3f} ms ({r['looked_at']} looked at)", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python -m bench.scheduler_cost " + " ".join(argv or []), "machine": platform.processor()
                or platform.machine(), "python": platform.python_version(),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        (args.out / "scheduler_cost.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        lines = ["| policy | queue | window | median ms | p95 ms | looked at |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['policy']} | {r['queue']} | {r['window']} | {r['median_ms']} | {r['p95_ms']} | {r['looked_at']} |"
                  for r in rows]
        (args.out / "scheduler_cost.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
