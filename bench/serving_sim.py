"""The serving bench's load sweep in the simulator, on the CPU: a GPU run's workloads against its
measured cost profile, for its policies, with means and 95% intervals over seeds. A what-if of that
run (serve/sim/simulate.py prices every step from the profile), never a measurement of a GPU.

    python -m bench.serving_sim results/serving/nvidia_h200/learned_r64_all7 --out DIR \\
        --seeds 0 1 2 3 4 5 6 7 8 9 --duration 10 [--loads 0.5 0.7 0.85] [--host-ms 3 --image-ms 10 --delora-x 4 ...]

From the run's folder: profile.json (what the policies plan with), serving.json (the policies and
their parameters), traces.json (each point's seeded workload spec: bench.serving_traces). With
--seeds the points' specs are regenerated with those seeds (and --duration); without, the run's own
traces are replayed. The device the simulator stands for is the profile, plus what the engine pays
beyond it (--host-ms per step, --image-ms per 1000 image tokens: the vision tower), with deLoRA
--delora-x times the profile's (a GPU's mixture steps dearer than profiled), seeded --noise on every
step, and --spike-share of the steps --spike-ms slower. Writes serving.csv, summary.csv, verdicts.csv,
table.md and config.json under --out.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

from bench.results import write_csv, write_json
from bench.serving_stats import summarize_points, summary_table, verdicts
from bench.serving_traces import spec_of
from serve.orchestrator import CostProfile, build_policy, generate
from serve.sim import SimConfig, simulate
from serve.sim.evaluate import METRIC_COLUMNS

NAME = re.compile(r"trace_(?P<sweep>[a-z]+)_(?P<x>[0-9.]+)_skew(?P<skew>[0-9.]+)_seed(?P<seed>[0-9]+)\.jsonl")
COLUMNS = ("sweep", "x", "policy", "seed", "rate", "skewness", *METRIC_COLUMNS, "unmerge_ms", "merge_ms",
           "mixture_ms", "guard_engaged", "guard_fallback_steps")


def run_points(folder: Path) -> tuple[CostProfile, dict[str, dict], dict[tuple, dict]]:
    """(profile, policy name -> params, (sweep, x, skewness, seed) -> workload spec) of a serving run."""
    missing = [n for n in ("profile.json", "serving.json", "traces.json") if not (folder / n).is_file()]
    if missing:
        raise ValueError(f"{folder}: not a serving bench run's folder, it has no {', '.join(missing)}")
    job = json.loads((folder / "serving.json").read_text())["meta"]["job"]
    policies = {}
    for p in job["policies"]:
        params = dict(p) if isinstance(p, dict) else {"name": p}
        policies[params.pop("name")] = params
    specs = {}
    for name, entry in json.loads((folder / "traces.json").read_text()).items():
        m = NAME.fullmatch(name)
        if m is None:
            raise ValueError(f"{folder}/traces.json: trace name {name!r} is not trace_<sweep>_<x>_skew<s>_seed<n>.jsonl")
        specs[(m["sweep"], float(m["x"]), float(m["skew"]), int(m["seed"]))] = entry["spec"]
    return CostProfile.load(folder / "profile.json"), policies, specs


def device_profile(profile: CostProfile, delora_x: float) -> CostProfile:
    """The profile with deLoRA `delora_x` times as dear: a GPU whose mixture steps cost more than profiled."""
    if delora_x == 1.0:
        return profile
    device = copy.deepcopy(profile)
    grid = device.lora["delora"]
    grid.values = [[delora_x * v for v in row] for row in grid.values]
    return device


def load_points(folder: Path, specs: dict[tuple, dict], loads: list[float], skewness: float | None,
                capacity_rps: float | None) -> dict[tuple, dict]:
    """The run's workload at other loads: rates at `loads` of its capacity (capacity.json unless given)."""
    if capacity_rps is None:
        path = folder / "capacity.json"
        if not path.is_file():
            raise ValueError(f"{folder}: --loads needs the run's capacity.json or --capacity")
        capacity_rps = json.loads(path.read_text())["capacity_rps"]
    template = specs[min(specs)]
    skew = template["skewness"] if skewness is None else skewness
    return {("load", x, skew, 0): {**template, "rate": x * capacity_rps, "skewness": skew} for x in loads}


def workloads(specs: dict[tuple, dict], seeds: list[int] | None, duration_s: float | None) -> dict[tuple, object]:
    """(sweep, x, skewness, seed) -> WorkloadSpec: the run's own, or each point's regenerated per seed."""
    out = {}
    for (sweep, x, skew, seed), values in sorted(specs.items()):
        for s in (seeds if seeds is not None else [seed]):
            spec = dataclasses.replace(spec_of(values), seed=s)
            if duration_s is not None:
                spec = dataclasses.replace(spec, duration_s=duration_s)
            out[(sweep, x, skew, s)] = spec
    return out


def sweep(args) -> list[dict]:
    profile, policies, specs = run_points(Path(args.run))
    if args.loads:
        specs = load_points(Path(args.run), specs, args.loads, args.skewness, args.capacity)
    if args.policies:
        unknown = sorted(set(args.policies) - set(policies))
        if unknown:
            raise ValueError(f"policies {unknown} are not in the run; it has {sorted(policies)}")
        policies = {k: v for k, v in policies.items() if k in args.policies}
    device = device_profile(profile, args.delora_x)
    rows = []
    for (sweep_name, x, skew, seed), spec in workloads(specs, args.seeds, args.duration).items():
        trace = generate(spec)
        for name, params in policies.items():
            sim = SimConfig(args.max_batch_size, args.max_tokens_per_step, host_ms=args.host_ms,
                            image_ms_per_ktoken=args.image_ms, step_noise=args.noise, noise_seed=seed,
                            spike_share=args.spike_share, spike_ms=args.spike_ms)
            result = simulate(trace, build_policy(name, profile, params), device, sim)
            m, guard = result.metrics.as_row(), result.policy_stats.get("guard") or {}
            rows.append({"sweep": sweep_name, "x": x, "policy": name, "seed": seed, "rate": spec.rate,
                         "skewness": skew, **{k: m[k] for k in METRIC_COLUMNS},
                         **{f"{k}_ms": v for k, v in result.mode_ms.items()},
                         "guard_engaged": guard.get("engaged", 0), "guard_fallback_steps": guard.get("fallback_steps", 0)})
        print(f"{sweep_name}={x:g} seed={seed}: " + ", ".join(
            f"{r['policy']} {r['avg_token_latency_ms']:.1f}" for r in rows[-len(policies):]), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.serving_sim", description=__doc__.split("\n")[0])
    ap.add_argument("run", help="a serving bench run's folder (profile.json, serving.json, traces.json)")
    ap.add_argument("--out", required=True, help="folder for the simulated results")
    ap.add_argument("--seeds", type=int, nargs="+", help="regenerate each point's trace with these seeds")
    ap.add_argument("--duration", type=float, help="seconds of arrivals per trace (with --seeds)")
    ap.add_argument("--loads", type=float, nargs="+", help="the run's workload at these shares of its capacity")
    ap.add_argument("--capacity", type=float, help="requests/s the loads are shares of (default: capacity.json)")
    ap.add_argument("--skewness", type=float, help="with --loads (default: the run's first point's)")
    ap.add_argument("--policies", nargs="+", help="a subset of the run's policies")
    ap.add_argument("--host-ms", type=float, default=0.0)
    ap.add_argument("--image-ms", type=float, default=0.0, help="ms per 1000 image tokens (the vision tower)")
    ap.add_argument("--delora-x", type=float, default=1.0, help="the device's deLoRA over the profile's")
    ap.add_argument("--noise", type=float, default=0.0, help="sigma of a lognormal factor on every step")
    ap.add_argument("--spike-share", type=float, default=0.0)
    ap.add_argument("--spike-ms", type=float, default=0.0)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-tokens-per-step", type=int, default=8192)
    args = ap.parse_args(argv)
    if (args.duration is not None or args.loads) and args.seeds is None:
        ap.error("--duration and --loads regenerate the traces: give --seeds too")
    if args.loads and any(not 0 < x <= 2 for x in args.loads):
        ap.error(f"--loads must be shares of capacity in (0, 2], got {args.loads}")
    if not args.delora_x > 0:
        ap.error(f"--delora-x must be > 0, got {args.delora_x}")
    t0 = time.perf_counter()
    try:
        rows = sweep(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize_points(rows)
    checks = verdicts(summary)
    write_csv(out / "serving.csv", rows, COLUMNS)
    write_csv(out / "summary.csv", summary)
    if checks:
        write_csv(out / "verdicts.csv", checks)
    lines = [summary_table(summary), ""] + [
        f"- {c['sweep']}={c['x']:g} skew={c['skewness']:g}: v_lora / best fixed ({c['best_fixed']}) {c['ratio_best']:.3f}"
        f"{'' if c['within_5pct'] else ' (over 5%)'}" for c in checks]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    write_json(out / "config.json", {**vars(args), "wall_s": round(time.perf_counter() - t0, 1),
                                     "note": "simulated on the CPU from the profile: not a GPU measurement"})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
