"""Scaling evaluation: the serving evaluation's workload on one GPU and on N, by replicas and by tensor parallelism.

Each setup serves the same model, adapters and policy and replays, by the wall clock, the
serving evaluation's generated workloads (bench.serving_replay) at rising request rates:
`rates` requests/s per GPU, times the setup's GPUs. A rate meets the latency target when at least
`attainment` of its requests finish within their application's latency target (aborted requests
count as missed). A setup's capacity is the highest rate before the first one that misses,
refined by linear interpolation of the met share between those two rates; its scaling efficiency
is capacity / (GPUs x the single GPU's capacity). The sweep of a setup stops at its first missed
rate: rates past the knee only cost time.

    single            one engine, in this process (the serving evaluation's engine)
    replicas          N engines on Ray Serve, one GPU each, behind ReplicatedEngine (adapter
                      affinity, a replica's capacity = its batch size, Ray's router)
    tensor_parallel   one engine split over N GPUs (torch.distributed: NCCL; gloo on CPU), rank 0
                      replaying through LeaderEngine

Every setup's rows are saved as they are measured (scaling_<setup>.json); a setup whose rows are
all there is not run again, so a stopped run resumes where it was. `report` (always run last)
writes scaling.csv, scaling.json and scaling.png from whatever setups are there.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.scaling_setups import SETUPS, run_setup
from bench.serving import ServingBenchJob
from .results import device_label, results_dir, write_csv, write_json

COLUMNS = ("setup", "gpus", "rate", "met_share", "meets_target", "slo_attainment", "completed", "requests",
           "aborted", "throughput_rps", "avg_token_latency_ms", "p50_ms", "p95_ms", "p99_ms", "switches",
           "steps_unmerge", "steps_merge", "steps_mixture", "replay_s")


@dataclass
class ScalingBenchJob(ServingBenchJob):
    setups: tuple[str, ...] = ("single", "replicas", "tensor_parallel")
    gpus: int = 2  # GPUs of the replicas and tensor_parallel setups
    rates: tuple[float, ...] = (10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0, 24.0)  # offered requests/s per GPU, rising
    skewness: tuple[float, ...] = (0.6,)
    policies: tuple = ("v_lora",)  # one policy, the same in every setup
    attainment: float = 0.9  # share of requests within their latency target for a rate to meet it
    replica_capacity: int | None = None  # requests a replica takes at once (default max_batch_size)
    mode_other_shares: tuple[float, ...] = ()
    fresh: bool = False  # measure every setup again instead of resuming
    out_dir: str = "results/scaling"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.setups = (self.setups,) if isinstance(self.setups, str) else tuple(self.setups)
        bad = [s for s in self.setups if s not in SETUPS]
        if bad or not self.setups:
            raise ValueError(f"setups {list(self.setups)}: give some of {list(SETUPS)}")
        if len(self.policies) != 1 or len(self.skewness) != 1:
            raise ValueError("the scaling evaluation runs one policy at one skewness")
        if list(self.rates) != sorted(set(self.rates)) or min(self.rates) <= 0:
            raise ValueError(f"rates {list(self.rates)} must rise and be positive")
        if self.gpus < 2 or not 0 < self.attainment <= 1:
            raise ValueError(f"gpus ({self.gpus}) must be at least 2 and attainment ({self.attainment}) in (0, 1]")
        self.workload()  # a bad workload (e.g. skewness for too few adapters) fails here, not after loading

    def setup_gpus(self, setup: str) -> int:
        return 1 if setup == "single" else self.gpus


def capacity(rows: list[dict], attainment: float) -> dict:
    """The highest rate measured within target, the interpolated capacity, and whether the sweep
    found the knee (a missed rate) or ended with every rate met (capacity is then a lower bound)."""
    rows = sorted(rows, key=lambda r: r["rate"])
    met = [r for r in rows if r["meets_target"]]
    first_miss = next((r for r in rows if not r["meets_target"]), None)
    below = [r for r in met if first_miss is None or r["rate"] < first_miss["rate"]]
    if not below:
        return {"measured_rps": 0.0, "capacity_rps": 0.0, "bounded": first_miss is not None}
    last = below[-1]
    if first_miss is None:
        return {"measured_rps": last["rate"], "capacity_rps": last["rate"], "bounded": False}
    a, b = last["met_share"], first_miss["met_share"]
    frac = (a - attainment) / (a - b) if a > b else 0.0
    return {"measured_rps": last["rate"], "bounded": True,
            "capacity_rps": last["rate"] + frac * (first_miss["rate"] - last["rate"])}


def run_scaling_bench(job: ScalingBenchJob) -> tuple[list[dict], dict]:
    """Runs the setups not yet measured, then writes the report; returns (rows, summary)."""
    if job.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda asked for but no CUDA device is available; use device=cpu with a tiny model")
        have = torch.cuda.device_count()
        if any(job.setup_gpus(s) > have for s in job.setups):
            raise RuntimeError(f"setups {list(job.setups)} need {job.gpus} GPUs; this machine has {have}")
    gpu = device_label(job.device)
    out = results_dir(job.out_dir, gpu)
    out.mkdir(parents=True, exist_ok=True)
    for setup in job.setups:
        path = out / f"scaling_{setup}.json"
        done = [] if job.fresh or not path.is_file() else json.loads(path.read_text())["rows"]
        if _complete(done, job):
            print(f"{setup}: measured already ({path}); fresh=true measures again", file=sys.stderr, flush=True)
            continue
        meta = dict(setup=setup, gpus=job.setup_gpus(setup), device=gpu, date=time.strftime("%Y-%m-%d"),
                    torch=torch.__version__, job=dataclasses.asdict(job))
        run_setup(setup, job, Path(tempfile.mkdtemp(prefix=f"scaling-{setup}-")), path, meta, done)
        # the next setup's engines (this process's on GPU 0, or a replica's there) size their K/V
        # cache from the memory they find free: none of this one's may stay cached
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return report(job, out)


def _complete(rows: list[dict], job: ScalingBenchJob) -> bool:
    """True when the saved rows reach the setup's first missed rate or its last rate."""
    return bool(rows) and (not rows[-1]["meets_target"] or len(rows) == len(job.rates))


def report(job: ScalingBenchJob, out: Path) -> tuple[list[dict], dict]:
    rows, setups = [], {}
    for setup in SETUPS:
        path = out / f"scaling_{setup}.json"
        if not path.is_file():
            continue
        saved = json.loads(path.read_text())
        rows += saved["rows"]
        setups[setup] = {**{k: saved["meta"].get(k) for k in ("gpus", "device", "date", "wall_s", "load_s")},
                         **capacity(saved["rows"], job.attainment)}
    base = setups.get("single", {}).get("capacity_rps")
    for s in setups.values():
        s["efficiency"] = s["capacity_rps"] / (s["gpus"] * base) if base else math.nan
    write_csv(out / "scaling.csv", rows, COLUMNS, drop_extra=True)
    summary = {"attainment": job.attainment, "setups": setups}
    write_json(out / "scaling.json", summary)
    _plot(rows, job, out / "scaling.png")
    print(f"{'setup':16s} {'GPUs':>4s} {'rate met':>9s} {'capacity':>9s} {'efficiency':>10s}")
    for name, s in setups.items():
        bound = "" if s["bounded"] else " (every rate met: a lower bound)"
        print(f"{name:16s} {s['gpus']:4d} {s['measured_rps']:9.1f} {s['capacity_rps']:9.2f} "
              f"{s['efficiency']:10.2f}{bound}")
    return rows, summary


def _plot(rows: list[dict], job: ScalingBenchJob, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for setup in dict.fromkeys(r["setup"] for r in rows):
        rs = [r for r in rows if r["setup"] == setup]
        ax.plot([r["rate"] for r in rs], [r["met_share"] for r in rs], marker="o",
                label=f"{setup} ({rs[0]['gpus']} GPU{'s' if rs[0]['gpus'] > 1 else ''})")
    ax.axhline(job.attainment, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("offered requests/s")
    ax.set_ylabel("share of requests within target")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
