"""The host cost of a policy per engine step, on the CPU: how long the step planner's plan() (the
view, the policy's decide, the admit list) and observe_step() (learning, the guard) take for each
policy, on a serving run's workloads with their images, in the simulator.

    python -m bench.policy_cost [results/serving/nvidia_h200/i48_confirm] --out DIR \\
        [--loads 0.5 0.7 1.5 3] [--seeds 0 1 2] [--duration 4] [--policies v_lora merge_only unmerge_only] [--repeat 3] \\
        [--runs 5] [--cprofile 25]

The engine runs the planner on the host in series with the GPU (serve/engine/engine.py: plan, then
the step, then observe_step), so every microsecond here is added to every step. The simulator
drives the engine's own scheduler and planner (serve/sim/simulate.py with time_host), so the
queues the planner sees are those the run's traces build at those loads (a load above 1 keeps a
backlog: at 3 the queue holds 30-70 requests). Times are wall-clock on this host: medians and p95
over all steps, each step's time the fastest of --repeat runs of the same trace (the simulator and
the policies are deterministic, every run takes the same steps, so other processes on a shared
host are left out). Writes policy_cost.csv (a row per policy and load) and policy_cost.json (plus
the command) under --out, with each policy's mean ms per generated token on the profile's device
as simulated, and with its host time paid on the simulated clock (SimConfig.charge_host: one more
run per trace, with this host's times). --runs K measures it all K times over (rows carry `run`) and
writes policy_cost_summary.csv: per policy and load, the median over runs of each run's median and
p95 host us per step, with their smallest and largest, so a shared host's noise shows. --cprofile N
prints v_lora's N dearest functions.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

from bench.results import write_csv, write_json
from bench.serving_sim import load_points, run_points, workloads
from serve.orchestrator import build_policy, generate
from serve.sim import SimConfig, simulate

DEFAULT_RUN = "results/serving/nvidia_h200/i48_confirm"
COLUMNS = ("policy", "load", "steps", "queue_median", "queue_max", "plan_us_median", "plan_us_p95",
           "observe_us_median", "observe_us_p95", "host_us_median", "host_us_p95", "host_us_mean", "ms_per_token",
           "ms_per_token_host_paid", "run")
SUMMARY = ("policy", "load", "runs", "host_us_median", "host_us_median_min", "host_us_median_max", "host_us_p95",
           "host_us_p95_min", "host_us_p95_max", "plan_us_median", "observe_us_median")


def with_images(trace, spec):
    """The trace with each request's image tokens (its frames' placeholders; the generator leaves
    them 0): the planner prices and reports them, as the engine's views carry them."""
    per_frame = {a.name: a.tokens_per_frame for a in spec.apps}
    out = []
    for r in trace:
        tpf = per_frame.get(r.app, 0)
        images = (r.prompt_tokens // tpf) * tpf if tpf else 0
        out.append(dataclasses.replace(r, image_tokens=min(images, r.prompt_tokens)))
    return out


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def measure(run: Path, loads: list[float], seeds: list[int], duration: float, policies: list[str],
            capacity: float | None = None, profiler: cProfile.Profile | None = None,
            sim: SimConfig | None = None, repeat: int = 1) -> list[dict]:
    sim = sim or SimConfig(time_host=True)
    profile, params, specs = run_points(run)
    unknown = sorted(set(policies) - set(params))
    if unknown:
        raise ValueError(f"policies {unknown} are not in the run; it has {sorted(params)}")
    specs = load_points(run, specs, loads, None, capacity)
    rows = []
    for load in loads:
        point = {k: v for k, v in specs.items() if k[1] == load}
        traces = [with_images(generate(spec), spec) for spec in workloads(point, seeds, duration).values()]
        for name in policies:
            samples, latency, charged = [], [], []
            for trace in traces:
                runs = []
                for _ in range(repeat):  # the same steps each time: the simulator and the policies are deterministic
                    policy = build_policy(name, profile, params[name])
                    if profiler is not None and name == "v_lora":
                        profiler.enable()
                    result = simulate(trace, policy, profile, sim)
                    if profiler is not None and name == "v_lora":
                        profiler.disable()
                    runs.append(result.host_us)
                latency.append(result.metrics.avg_token_latency_ms)
                # the same trace with the host time paid on the simulated clock, as the engine's loop pays it
                paid = simulate(trace, build_policy(name, profile, params[name]), profile,
                                dataclasses.replace(sim, charge_host=True))
                charged.append(paid.metrics.avg_token_latency_ms)
                # each step's fastest repeat: what the work costs, without the other processes of a shared host
                samples += [(min(p for p, _, _ in same), min(o for _, o, _ in same), same[0][2]) for same in zip(*runs)]
            plan = [p for p, _, _ in samples]
            obs = [o for _, o, _ in samples]
            host = [p + o for p, o, _ in samples]
            queue = [q for _, _, q in samples]
            rows.append({"policy": name, "load": load, "steps": len(samples), "queue_median": _q(queue, 0.5),
                         "queue_max": max(queue, default=0),
                         "plan_us_median": round(_q(plan, 0.5), 1), "plan_us_p95": round(_q(plan, 0.95), 1),
                         "observe_us_median": round(_q(obs, 0.5), 1), "observe_us_p95": round(_q(obs, 0.95), 1),
                         "host_us_median": round(_q(host, 0.5), 1), "host_us_p95": round(_q(host, 0.95), 1),
                         "host_us_mean": round(sum(host) / max(1, len(host)), 1),
                         "ms_per_token": round(sum(latency) / len(latency), 3),
                         "ms_per_token_host_paid": round(sum(charged) / len(charged), 3)})
            r = rows[-1]
            print(f"load={load:g} {name}: {r['steps']} steps, queue median {r['queue_median']} (max {r['queue_max']}); "
                  f"plan {r['plan_us_median']} us (p95 {r['plan_us_p95']}), observe {r['observe_us_median']} us "
                  f"(p95 {r['observe_us_p95']}), host per step {r['host_us_median']} us (p95 {r['host_us_p95']}); "
                  f"{r['ms_per_token']} ms/token, {r['ms_per_token_host_paid']} with the host time paid",
                  flush=True)
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per policy and load: the median over runs of each run's median (and p95), with the spread."""
    out = {}
    for r in rows:
        out.setdefault((r["policy"], r["load"]), []).append(r)
    summary = []
    for (policy, load), runs in out.items():
        row = {"policy": policy, "load": load, "runs": len(runs)}
        for col in ("host_us_median", "host_us_p95", "plan_us_median", "observe_us_median"):
            values = [r[col] for r in runs]
            row[col] = round(statistics.median(values), 1)
            if col.startswith("host"):
                row[col + "_min"], row[col + "_max"] = min(values), max(values)
        summary.append(row)
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.policy_cost", description=__doc__.split("\n")[0])
    ap.add_argument("run", nargs="?", default=DEFAULT_RUN,
                    help="a serving bench run's folder (profile.json, serving.json, traces.json)")
    ap.add_argument("--out", help="folder for policy_cost.csv and policy_cost.json")
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.7, 1.5, 3.0])
    ap.add_argument("--capacity", type=float, help="requests/s the loads are shares of (default: the run's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--duration", type=float, default=4.0, help="seconds of arrivals per trace")
    ap.add_argument("--policies", nargs="+", default=["v_lora", "merge_only", "unmerge_only"])
    ap.add_argument("--repeat", type=int, default=3, help="runs of each trace; each step's fastest is kept")
    ap.add_argument("--runs", type=int, default=1, help="measure everything this many times (the host's noise)")
    ap.add_argument("--cprofile", type=int, default=0, help="print v_lora's N dearest functions")
    args = ap.parse_args(argv)
    run = Path(args.run)
    if not (run / "serving.json").is_file():
        ap.error(f"{run}: not a serving bench run's folder (no serving.json)")
    job = json.loads((run / "serving.json").read_text())["meta"]["job"]
    capacity = args.capacity or job.get("capacity_rps")
    if capacity is None and not (run / "capacity.json").is_file():
        ap.error(f"{run}: no capacity.json and no capacity_rps in serving.json; pass --capacity")
    if args.duration <= 0 or any(x <= 0 for x in args.loads) or args.repeat < 1 or args.runs < 1:
        ap.error("--duration and --loads must be > 0, --repeat and --runs >= 1")
    profiler = cProfile.Profile() if args.cprofile else None
    started = time.time()
    sim = SimConfig(job.get("max_batch_size", 32), job.get("max_tokens_per_step", 8192), time_host=True)
    rows = []
    for k in range(args.runs):
        rows += [{**r, "run": k} for r in measure(run, args.loads, args.seeds, args.duration, args.policies, capacity,
                                                   profiler, sim, args.repeat)]
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.cprofile)
        print(text.getvalue())
    if args.out:
        out = Path(args.out)
        write_csv(out / "policy_cost.csv", rows, COLUMNS)
        if args.runs > 1:
            write_csv(out / "policy_cost_summary.csv", summarize(rows), SUMMARY)
        write_json(out / "policy_cost.json", {"command": "python -m bench.policy_cost " + " ".join(argv or sys.argv[1:]),
                                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
                                              "host": platform.processor() or platform.machine(),
                                              "python": platform.python_version(), "cpus": os.cpu_count(),
                                              # other work on a shared host: its 1-minute load when the runs ended
                                              "load_average_1min": os.getloadavg()[0], "rows": rows,
                                              "summary": summarize(rows)})
        print(f"wrote {out}/policy_cost.csv and policy_cost.json", file=sys.stderr)


if __name__ == "__main__":
    main()
