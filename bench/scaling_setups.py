"""The scaling evaluation's setups: each builds its engine(s), warms up and sweeps the request rates.

Every setup replays the same traces (serve.orchestrator's generator, one per rate) through the
Engine API: the engine itself (single), `ReplicatedEngine` over a Ray Serve deployment (replicas),
or `LeaderEngine` on rank 0 of a tensor-parallel group (tensor_parallel). Each rate's requests
carry images and words of their own, so no rate finds another's K/V or vision embeddings in a
cache (replicas cannot empty theirs from the front end). Every engine process gets the same
share of the host's cores, cores / gpus torch threads (Ray gives a replica that many through
OMP_NUM_THREADS): a single engine with all of them would compare a different machine, and one
with more threads than cores of its own was measured slower. Rows are saved after every rate.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from pathlib import Path

import torch

from bench.serving import engine_plan, random_weights, serving_engine
from bench.serving_replay import build_requests, replay
from serve.orchestrator import generate
from .results import write_json

SETUPS = ("single", "replicas", "tensor_parallel")


def save_rows(path: str | Path, rows: list[dict], meta: dict) -> None:
    """meta["t0"] (perf_counter at the setup's start) becomes wall_s."""
    meta = {k: v for k, v in meta.items() if k != "t0"} | {"wall_s": time.perf_counter() - meta["t0"]}
    write_json(path, {"meta": meta, "rows": rows})


def sweep(engine, job, setup: str, names: list[str], path: str, meta: dict, done: list[dict]) -> list[dict]:
    """Warm-up replay, then the rates from the first one not in `done`, stopping at the first missed."""
    gpus = job.setup_gpus(setup)
    print(f"{setup} ({gpus} GPU): ready after {meta.get('load_s', 0):.0f} s", file=sys.stderr, flush=True)
    base = dataclasses.replace(job.workload(), skewness=job.skewness[0])
    text = sum(job.text_tokens) // 2

    def requests(trace, seed):
        return build_requests(trace, names, job.image_size, seed, text, job.video_frames[1])

    if job.warmup_s > 0:  # compiles, graph captures, autotuning, first mode switches: not measured
        warm = generate(dataclasses.replace(base, rate=job.rates[0] * gpus, duration_s=job.warmup_s,
                                            seed=job.seed + 10**6))
        replay(engine, warm, requests(warm, job.seed + 10**6), job.drain_s, job.prepare_threads)
    rows = list(done)
    for k, per_gpu in enumerate(job.rates):
        if k < len(done):
            continue
        trace = generate(dataclasses.replace(base, rate=per_gpu * gpus))
        m, extra = replay(engine, trace, requests(trace, job.seed + 1 + k), job.drain_s, job.prepare_threads)
        met = m["slo_attainment"] * m["completed"] / m["requests"] if m["requests"] and m["completed"] else 0.0
        rows.append({"setup": setup, "gpus": gpus, "rate": per_gpu * gpus, "met_share": met,
                     "meets_target": met >= job.attainment, **m, **extra})
        r = rows[-1]
        print(f"{setup} ({gpus} GPU) {r['rate']:g} req/s: {met:.3f} within target, p95 {r['p95_ms']:.0f} ms, "
              f"{r['throughput_rps']:.2f} req/s served, {r['completed']}/{r['requests']} done",
              file=sys.stderr, flush=True)
        save_rows(path, rows, meta)
        if not r["meets_target"]:
            break
    return rows


def run_setup(setup: str, job, workdir: Path, path: Path, meta: dict, done: list[dict]) -> None:
    policy = next(iter(job.policy_params().items()))
    meta = {**meta, "t0": time.perf_counter()}
    {"single": _single, "replicas": _replicas, "tensor_parallel": _tensor_parallel}[setup](
        job, workdir, policy, str(path), meta, done)


def _engine_threads(job) -> int:
    """torch threads of one engine process: its share of the host's cores."""
    return max(1, (os.cpu_count() or 1) // job.gpus)


def _single(job, workdir, policy, path, meta, done) -> None:
    torch.set_num_threads(_engine_threads(job))
    engine, names = serving_engine(job, workdir, policy)
    meta["load_s"] = time.perf_counter() - meta["t0"]
    sweep(engine, job, "single", names, path, meta, done)


def _rank_weights(job, workdir: str, device: str) -> tuple[str, dict]:
    """Runs inside a replica or a tensor-parallel rank: the zoo model's weights on its `device`
    (same seed, same weights everywhere)."""
    return workdir, random_weights(job, Path(workdir) / f"rank-{os.getpid()}", device=device)


def _replicas(job, workdir, policy, path, meta, done) -> None:
    from ray import serve

    from serve.distributed.replicas import ReplicatedEngine, build_deployment, start_serve, stop_serve

    ckpt, config, names = engine_plan(job, workdir, policy)
    cuda = job.device.startswith("cuda")
    if cuda:
        config.device = "cuda"  # each replica sees its own GPU as the first
    adapters = dict(a.split("=", 1) for a in config.adapters)
    start_serve(num_cpus=max(2, os.cpu_count() or 2), num_gpus=job.gpus if cuda else 0)
    try:
        deployment = build_deployment(
            str(ckpt), dataclasses.asdict(config), adapters, num_replicas=job.gpus,
            # Ray sets a replica's OMP_NUM_THREADS to its CPUs (1 for none): give each its share of the
            # host's cores, as many as a single engine's process has per GPU
            ray_actor_options={"num_gpus": 1, "num_cpus": _engine_threads(job)} if cuda else {"num_cpus": 0},
            max_ongoing_requests=job.replica_capacity or job.max_batch_size, max_adapters_per_replica=len(names),
            builder=None if job.checkpoint else functools.partial(_rank_weights, job, str(workdir)))
        engine = ReplicatedEngine(serve.run(deployment, name="vlora-scaling", route_prefix=None))
        meta["load_s"] = time.perf_counter() - meta["t0"]
        try:
            rows = sweep(engine, job, "replicas", names, path, meta, done)
        finally:
            engine.close()
        meta["by_replica"] = dict(engine.stats().by_replica)
        save_rows(path, rows, meta)
    finally:
        stop_serve()


def _tensor_parallel(job, workdir, policy, path, meta, done) -> None:
    """This process leads a group of job.gpus ranks (GPU 0 here, the others in child processes)."""
    from serve.distributed.local_group import LocalGroup

    ckpt, config, names = engine_plan(job, workdir, policy)
    config.tensor_parallel_size = job.gpus
    group = LocalGroup(str(ckpt), dataclasses.asdict(config), threads=_engine_threads(job),
                       builder=None if job.checkpoint else functools.partial(_rank_weights, job, str(workdir)))
    meta["load_s"] = time.perf_counter() - meta["t0"]
    try:
        sweep(group.engine, job, "tensor_parallel", names, path, meta, done)
    finally:
        group.close()
