"""Policy sweeps in the simulator: latency vs request rate, vs skewness, vs number of adapters.

Every (sweep, x, policy, seed) point simulates one generated workload and becomes one CSV row.
Rows carry a fingerprint of everything that shaped them (profile, workload, engine limits,
policy parameters), so a rerun keeps the rows that still match and simulates only the rest.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from serve.orchestrator.profile import CostProfile
from serve.orchestrator.registry import build_policy
from serve.orchestrator.workload import WorkloadSpec, generate

from .simulate import SimConfig, simulate

SWEEPS = ("rate", "skewness", "adapters")
METRIC_COLUMNS = ("avg_token_latency_ms", "avg_latency_ms", "p50_ms", "p95_ms", "p99_ms", "throughput_rps",
                  "throughput_tps", "slo_attainment", "avg_wait_ms", "max_wait_ms", "switches", "switch_ms",
                  "completed", "requests")
COLUMNS = ("sweep", "x", "policy", "seed", "fingerprint", *METRIC_COLUMNS,
           "unmerge_ms", "merge_ms", "mixture_ms", "wall_s")


@dataclass
class EvalJob:
    policies: dict[str, dict]  # policy name -> its parameters
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)  # base; each sweep varies one knob
    max_batch_size: int = 32
    max_tokens_per_step: int = 4096
    rates: list[float] = field(default_factory=lambda: [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    skewness: list[float] = field(default_factory=lambda: [0.3, 0.5, 0.7, 0.9])
    adapters: list[int] = field(default_factory=lambda: [2, 8, 32, 128])
    seeds: list[int] = field(default_factory=lambda: [0])
    sweeps: list[str] = field(default_factory=lambda: list(SWEEPS))

    def __post_init__(self) -> None:
        bad = sorted(set(self.sweeps) - set(SWEEPS))
        if bad:
            raise ValueError(f"sweeps {bad} unknown; valid: {SWEEPS}")


def points(job: EvalJob) -> list[tuple[str, float, WorkloadSpec]]:
    """(sweep, x, workload spec without seed) for every point of the selected sweeps."""
    base, out = job.workload, []
    if "rate" in job.sweeps:
        out += [("rate", float(x), replace(base, rate=float(x))) for x in job.rates]
    if "skewness" in job.sweeps:
        out += [("skewness", float(x), replace(base, skewness=float(x))) for x in job.skewness]
    if "adapters" in job.sweeps:
        out += [("adapters", float(x), replace(base, num_adapters=int(x),
                                               skewness=max(base.skewness, 1 / int(x)))) for x in job.adapters]
    return out


def fingerprint(profile: CostProfile, spec: WorkloadSpec, job: EvalJob, policy: str) -> str:
    blob = json.dumps([profile.to_dict(), asdict(spec), job.max_batch_size, job.max_tokens_per_step,
                       policy, job.policies[policy]], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _key(row: dict) -> tuple:
    return row["sweep"], float(row["x"]), row["policy"], int(row["seed"]), row["fingerprint"]


def read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for k in COLUMNS[5:]:
            row[k] = float(row[k]) if row[k] not in ("", "nan") else math.nan
    return rows


def run_sweeps(job: EvalJob, profile: CostProfile, out_csv: str | Path,
               progress: Callable[[str], None] = print) -> list[dict]:
    """Simulates every point not already in `out_csv` (appending as it goes) and returns the
    rows of this job, old and new."""
    out_csv = Path(out_csv)
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    done = {_key(r): r for r in read_rows(out_csv)}
    todo = [(sweep, x, spec, name, seed) for sweep, x, spec in points(job)
            for seed in job.seeds for name in job.policies]
    rows, fresh = [], not out_csv.is_file()
    with open(out_csv, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        if fresh:
            writer.writeheader()
        for i, (sweep, x, spec, name, seed) in enumerate(todo, 1):
            fp = fingerprint(profile, spec, job, name)
            key = (sweep, x, name, seed, fp)
            if key in done:
                rows.append(done[key])
                continue
            t0 = time.perf_counter()
            trace = generate(replace(spec, seed=seed))
            policy = build_policy(name, profile, job.policies[name])
            result = simulate(trace, policy, profile, SimConfig(job.max_batch_size, job.max_tokens_per_step))
            m = result.metrics.as_row()
            row = {"sweep": sweep, "x": x, "policy": name, "seed": seed, "fingerprint": fp,
                   **{k: m[k] for k in METRIC_COLUMNS},
                   **{f"{k}_ms": v for k, v in result.mode_ms.items()}, "wall_s": time.perf_counter() - t0}
            writer.writerow(row)
            f.flush()
            rows.append(row)
            progress(f"[{i}/{len(todo)}] {sweep}={x:g} {name} seed={seed}: "
                     f"{row['avg_token_latency_ms']:.1f} ms/token, {row['switches']} switches "
                     f"({row['wall_s']:.1f} s)")
    return rows


def aggregate(rows: list[dict], metric: str = "avg_token_latency_ms") -> dict[str, dict[float, dict[str, float]]]:
    """sweep -> x -> policy -> mean of `metric` over seeds."""
    acc: dict = {}
    for r in rows:
        acc.setdefault(r["sweep"], {}).setdefault(float(r["x"]), {}).setdefault(r["policy"], []).append(
            float(r[metric]))
    return {s: {x: {p: sum(v) / len(v) for p, v in by_p.items()} for x, by_p in sorted(by_x.items())}
            for s, by_x in acc.items()}
