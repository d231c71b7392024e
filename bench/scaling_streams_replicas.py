"""The scaling streams workload's replicas setup: Ray Serve replicas (one a GPU, each warm before
Ray routes to it) behind ReplicatedEngine and the RPyC front end, searched, and the kill point on
the most GPUs, whose kill picks a replica that holds requests."""

from __future__ import annotations

import functools
import os
import time

from .scaling_streams import APP, ScalingStreamsJob, _log, _Plan, _search, _threads, _weights
from .scaling_streams_point import run_scaling_point


class Deployments:
    """The replicas of one GPU count on a local Ray cluster, kept from the search to the kill point
    of the same count (one start); another count, or close(), takes them down."""

    def __init__(self, job: ScalingStreamsJob, plan: _Plan):
        self.job, self.plan, self.gpus, self.engine = job, plan, 0, None

    def get(self, gpus: int):
        """(ReplicatedEngine over `gpus` warm replicas, seconds it took to start them; 0 if running)."""
        from ray import serve

        from serve.distributed.replicas import ReplicatedEngine, build_deployment, start_serve

        if self.engine is not None and self.gpus == gpus:
            return self.engine, 0.0
        self.close()
        job, plan, cuda = self.job, self.plan, self.job.device.startswith("cuda")
        t0 = time.perf_counter()
        start_serve(num_cpus=max(2, os.cpu_count() or 2), num_gpus=gpus if cuda else 0)
        self.gpus = gpus
        deployment = build_deployment(
            str(plan.workdir), plan.config, plan.adapters, num_replicas=gpus,
            ray_actor_options={"num_gpus": 1, "num_cpus": _threads(job)} if cuda else {"num_cpus": 0},
            max_ongoing_requests=job.replica_capacity or job.max_batch_size, max_adapters_per_replica=job.adapters,
            builder=functools.partial(_weights, job.model, job.seed, job.dtype, str(plan.workdir)))
        self.engine = ReplicatedEngine(serve.run(deployment, name=APP, route_prefix=None))  # replicas warm up first
        return self.engine, time.perf_counter() - t0

    def close(self) -> None:
        from serve.distributed.replicas import stop_serve

        if self.gpus:
            if self.engine is not None:
                self.engine.close()
            stop_serve()
        self.gpus, self.engine = 0, None


def run_replicas(job: ScalingStreamsJob, deployments: Deployments, gpus: int, meta: dict, save=None) -> list[dict]:
    """The streams search on `gpus` replicas (save: as bench.scaling_streams._search's)."""
    engine, meta["load_s"] = deployments.get(gpus)
    before = dict(engine.stats().by_replica)
    rows = _search(engine, job, deployments.plan, "replicas", gpus, save=save)
    meta["by_replica"] = {r: n - before.get(r, 0) for r, n in engine.stats().by_replica.items()}
    return rows


def run_kill(job: ScalingStreamsJob, deployments: Deployments, gpus: int, meta: dict,
             measured: int | None) -> list[dict]:
    """The kill point on `gpus` replicas: kill_cameras, or kill_share of the `measured` cameras."""
    n = job.kill_cameras if job.kill_cameras is not None else round(job.kill_share * (measured or 0))
    if n < 1:
        _log(f"no kill point: {n} camera(s) (kill_cameras, or kill_share x the replicas' measured {measured})")
        return []
    engine, meta["load_s"] = deployments.get(gpus)
    plan, names = deployments.plan, list(deployments.plan.adapters)
    if meta["load_s"] and job.warmup_point_s > 0:  # fresh replicas: compiles and adapter loads, not measured
        run_scaling_point(engine, job, n, plan.chunks, names, seconds=job.warmup_point_s)
    row = run_scaling_point(engine, job, n, plan.chunks, names, kill=functools.partial(kill_busiest_replica, engine))
    return [{"setup": "replicas", "gpus": gpus, **row}]


def kill_busiest_replica(engine, app: str = APP, wait_s: float = 3.0) -> tuple[str, float, int]:
    """Kills the process of one of the app's replicas, the first seen holding requests (polled for up
    to wait_s; else the one that answered the most), so that some of its requests must be sent again;
    returns its id, the time of the kill (perf_counter) and the requests it held when last asked.
    Ray Serve starts a replacement."""
    import ray

    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if "SERVE_REPLICA" in a["name"] and f"::{app}#" in a["name"]]
    if not actors:
        raise RuntimeError(f"no replica of app {app!r} to kill")
    handles = [ray.get_actor(a["name"], namespace=a["namespace"]) for a in actors]
    answered = engine.stats().by_replica
    victim = max(range(len(actors)), key=lambda i: answered.get(actors[i]["name"].rsplit("#", 1)[-1], 0))
    end, held = time.monotonic() + wait_s, 0
    while time.monotonic() < end:
        ongoing = ray.get([h.get_num_ongoing_requests.remote() for h in handles])
        if max(ongoing) > 0:
            victim = max(range(len(actors)), key=lambda i: ongoing[i])
            held = ongoing[victim]
            break
        time.sleep(0.002)
    ray.kill(handles[victim], no_restart=False)
    return actors[victim]["name"].rsplit("#", 1)[-1], time.perf_counter(), held
