"""`vlora bench`: GPU benchmarks with committed-results output (CSV, summary JSON, PNG)."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..config import to_dataclass
from bench.results import write_csv

SUITES = ("kernels", "merge", "engine", "adapters", "serving", "streams", "scaling", "soak", "vision", "train",
          "offline", "fp8", "tp")


def run(cfg: DictConfig) -> dict:
    import torch

    from bench.kernels import BenchJob, run_kernel_bench
    from bench.kernels_report import plot, print_summary, summarize, write_summary
    from bench.merge import bench_merge
    from vlora_kernels.timing import copy_bandwidth_gbs
    from vlora_kernels.workload import DTYPES

    b = cfg.bench
    if b.suite not in SUITES:
        raise SystemExit(f"bench.suite={b.suite!r} is not one of {SUITES}")
    if b.suite in ("serving", "scaling"):  # before the CUDA check: device=cpu with a tiny zoo model runs anywhere
        return _replay(b)
    if b.suite == "streams":  # before the CUDA check too: device=cpu with a tiny zoo model runs anywhere
        return _streams(b)
    if b.suite == "soak":  # a CPU server by default
        return _soak(b)
    if b.suite == "vision":  # device=cpu with a tiny zoo model runs anywhere
        return _vision(b)
    if b.suite == "train":  # device=cpu with a tiny zoo model runs anywhere too
        return _train(b)
    if b.suite == "offline":  # the offline stage on the CPU default, fresh per seed
        return _offline(b)
    if b.suite == "fp8":  # device=cpu with a tiny zoo model runs anywhere
        return _fp8(b)
    if b.suite == "tp":  # device=cpu with the tiny shape runs anywhere (gloo ranks)
        return _tp(b)
    if not torch.cuda.is_available():
        raise SystemExit("vlora bench times GPU kernels; no CUDA device is available here")
    fields = {k: v for k, v in OmegaConf.to_container(b, resolve=True).items()
              if k not in ("suite", "engine", "adapters", "serving", "streams", "scaling", "soak", "vision", "train", "offline",
                           "fp8", "tp")}
    if b.suite == "adapters":
        from bench.adapters import AdapterBenchJob, run_adapter_bench

        values = OmegaConf.to_container(b.adapters, resolve=True)
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        rows, meta = run_adapter_bench(to_dataclass(AdapterBenchJob, values, out_dir=fields["out_dir"]))
        return {"adapters": rows, "meta": meta}
    if b.suite == "engine":
        from bench.engine import EngineBenchJob, run_engine_bench

        engine_fields = OmegaConf.to_container(b.engine, resolve=True)
        engine_fields["batch_sizes"] = tuple(engine_fields["batch_sizes"])
        rows, meta = run_engine_bench(to_dataclass(EngineBenchJob, engine_fields, out_dir=fields["out_dir"]))
        return {"engine": rows, "meta": meta}
    job = to_dataclass(BenchJob, fields)
    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[job.dtype]
    rows, meta = run_kernel_bench(job) if b.suite == "kernels" else ([], None)
    gbs = meta["copy_gbs"] if meta else copy_bandwidth_gbs()
    merge_rows = []
    for model in job.merge_models:
        for rank in job.merge_ranks:
            merge_rows += bench_merge(model, rank, dtype, gbs)
            print(f"merge {model} r={rank} done", file=sys.stderr, flush=True)
    if merge_rows:
        write_csv(out / "merge.csv", merge_rows)
    if not rows:
        for r in merge_rows:
            print(r)
        return {"merge": merge_rows}
    summary = summarize(rows, merge_rows, meta)
    write_summary(summary, out)
    plot(rows, out / "kernels.png")
    print_summary(summary)
    return summary


def _policies(values: dict) -> tuple:
    """values["policies"] with each name that has a conf/orchestrator/<name>.yaml replaced by it."""
    from ..config import CONF_DIR

    policies = []
    for p in values.pop("policies"):
        group = Path(CONF_DIR) / "orchestrator" / f"{p}.yaml" if isinstance(p, str) else None
        policies.append(OmegaConf.to_container(OmegaConf.load(group)) if group and group.is_file() else p)
    return tuple(policies)


def _replay(b: DictConfig) -> dict:
    """suite=serving: every orchestrator policy on the real engine; suite=scaling: one policy on one
    GPU and on several. Named policies take conf/orchestrator/<name>.yaml."""
    if b.suite == "serving":
        from bench.serving import ServingBenchJob as Job
        from bench.serving import run_serving_bench as run_job
    else:
        from bench.scaling import ScalingBenchJob as Job
        from bench.scaling import run_scaling_bench as run_job
    values = OmegaConf.to_container(b[b.suite], resolve=True)
    if b.suite == "scaling":  # workload=streams: cameras with heads on one GPU and on replicas (bench.scaling_streams)
        workload, streams = values.pop("workload", "serving"), values.pop("streams", None) or {}
        if workload != "serving":
            from bench.scaling_streams import run_streams_scaling, streams_job

            rows, meta = run_streams_scaling(streams_job(workload, streams, b.out_dir))
            return {"scaling": rows, "meta": meta}
    policies = _policies(values)
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    rows, meta = run_job(to_dataclass(Job, values, policies=policies, out_dir=b.out_dir))
    return {b.suite: rows, "meta": meta}


def _streams(b: DictConfig) -> dict:
    """N synthetic camera streams against the RPyC server; a named policy takes conf/orchestrator/<name>.yaml."""
    import shlex

    from bench.streams import StreamsBenchJob, run_streams_bench

    from ..config import CONF_DIR

    values = OmegaConf.to_container(b.streams, resolve=True)
    if values.get("policy", "fcfs") != "fcfs":
        group = Path(CONF_DIR) / "orchestrator" / f"{values['policy']}.yaml"
        if not group.is_file():
            raise SystemExit(f"bench.streams.policy={values['policy']!r}: no {group}")
        params = OmegaConf.to_container(OmegaConf.load(group), resolve=True)
        values["policy"], values["policy_params"] = params.pop("name"), params
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    prog = Path(sys.argv[0]).name  # vlora.cli hands Hydra sys.argv = ["vlora-bench", overrides...]
    command = " ".join(["vlora bench" if prog == "vlora-bench" else prog, *map(shlex.quote, sys.argv[1:])])
    rows, meta = run_streams_bench(to_dataclass(StreamsBenchJob, values, out_dir=b.out_dir, command=command))
    return {"streams": rows, "meta": meta}


def _vision(b: DictConfig) -> dict:
    """The Qwen vision path per camera chunk: towers, prompt CPU, device pixels (bench/vision.py)."""
    from bench.vision import VisionBenchJob, run_vision_bench

    values = {k: tuple(v) if isinstance(v, list) else v
              for k, v in OmegaConf.to_container(b.vision, resolve=True).items()}
    rows, meta = run_vision_bench(to_dataclass(VisionBenchJob, values, out_dir=b.out_dir, command=_command()))
    return {"vision": rows, "meta": meta}


def _train(b: DictConfig) -> dict:
    """Our trainer against plain transformers + PEFT on the same batches (bench/train.py)."""
    from bench.train import TrainBenchJob, run_train_bench

    values = {k: tuple(v) if isinstance(v, list) else v
              for k, v in OmegaConf.to_container(b.train, resolve=True).items()}
    rows, meta = run_train_bench(to_dataclass(TrainBenchJob, values, out_dir=b.out_dir, command=_command()))
    return {"train": rows, "meta": meta}


def _offline(b: DictConfig) -> dict:
    """`vlora offline` per seed in a home of its own, then seeds.md / seeds.json (bench/offline_seeds.py)."""
    from bench.offline_seeds import main

    o = b.offline
    argv = ["--root", str(o.root), "--seeds", *map(str, o.seeds), "--out", str(b.out_dir)]
    rows = main(argv + (["--", *o.overrides] if o.overrides else []), command=_command())
    return {"offline": rows}


def _fp8(b: DictConfig) -> dict:
    """FP8 projections against bf16, both against fp32: accuracy, decode steps, memory, switches (bench/fp8.py)."""
    from bench.fp8 import Fp8BenchJob, run_fp8_bench

    values = {k: tuple(v) if isinstance(v, list) else v
              for k, v in OmegaConf.to_container(b.fp8, resolve=True).items()}
    rows, meta = run_fp8_bench(to_dataclass(Fp8BenchJob, values, out_dir=b.out_dir, command=_command()))
    return {"fp8": rows, "meta": meta}


def _tp(b: DictConfig) -> dict:
    """Tensor parallel against one GPU: parity in every LoRA mode, decode / prefill / vision times (bench/tp.py)."""
    from bench.tp import TpBenchJob, run_tp_bench

    values = {k: tuple(v) if isinstance(v, list) else v
              for k, v in OmegaConf.to_container(b.tp, resolve=True).items()}
    try:
        job = to_dataclass(TpBenchJob, values, out_dir=b.out_dir, command=_command())
        rows, meta = run_tp_bench(job)
    except ValueError as e:  # a bad option: one line, before any model is built
        if "bench.tp" not in str(e):
            raise
        raise SystemExit(str(e)) from None
    return {"tp": rows, "meta": meta}


def _command() -> str:
    import shlex

    prog = Path(sys.argv[0]).name  # vlora.cli hands Hydra sys.argv = ["vlora-bench", overrides...]
    return " ".join(["vlora bench" if prog == "vlora-bench" else prog, *map(shlex.quote, sys.argv[1:])])


def _soak(b: DictConfig) -> dict:
    """Every attack class against a real `vlora serve`, then the leak checks; preset=quick takes
    bench.soak.quick's values over the defaults (a few seconds per phase)."""
    from bench.soak import SoakJob, run_soak

    values = OmegaConf.to_container(b.soak, resolve=True)
    preset, quick = values.pop("preset"), values.pop("quick")
    if preset not in ("full", "quick"):
        raise SystemExit(f"bench.soak.preset={preset!r} is not one of ('full', 'quick')")
    if preset == "quick":
        values.update(quick)
    checks, report = run_soak(to_dataclass(SoakJob, values, out_dir=b.out_dir, command=_command()))
    return {"soak": checks, "report": report}
