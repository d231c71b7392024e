"""The scaling streams workload's replicas setup: Ray Serve replicas (one a GPU, each warm before
Ray routes to it) behind ReplicatedEngine and the RPyC front end, searched, then (on the most GPUs)
the kill point, whose kill picks a replica that holds requests."""

from __future__ import annotations

import functools
import os
import time

from .scaling_streams import APP, ScalingStreamsJob, _log, _Plan, _search, _threads, _weights
from .scaling_streams_point import run_scaling_point


def run_replicas(job: ScalingStreamsJob, plan: _Plan, gpus: int, meta: dict) -> list[dict]:
    from ray import serve

    from serve.distributed.replicas import ReplicatedEngine, build_deployment, start_serve, stop_serve


    cuda = job.device.startswith("cuda")
    t0 = time.perf_counter()
    start_serve(num_cpus=max(2, os.cpu_count() or 2), num_gpus=gpus if cuda else 0)
    try:
        deployment = build_deployment(
            str(plan.workdir), plan.config, plan.adapters, num_replicas=gpus,
            ray_actor_options={"num_gpus": 1, "num_cpus": _threads(job)} if cuda else {"num_cpus": 0},
            max_ongoing_requests=job.replica_capacity or job.max_batch_size, max_adapters_per_replica=job.adapters,
            builder=functools.partial(_weights, job.model, job.seed, job.dtype, str(plan.workdir)))
        engine = ReplicatedEngine(serve.run(deployment, name=APP, route_prefix=None))  # replicas warm up first
        meta["load_s"] = time.perf_counter() - t0
        try:
            rows = _search(engine, job, plan, "replicas", gpus)
            cameras = max((r["streams"] for r in rows if r["pass"]), default=0)
            kill_n = job.kill_cameras if job.kill_cameras is not None else round(job.kill_share * cameras)
            if gpus == max(job.gpus) and kill_n > 0 and gpus > 1:
                row = run_scaling_point(engine, job, kill_n, plan.chunks, list(plan.adapters),
                                        kill=functools.partial(kill_busiest_replica, engine))
                rows.append({"setup": "replicas", "gpus": gpus, **row})
            elif gpus == max(job.gpus):
                _log(f"no kill point: {kill_n} camera(s) on {gpus} replica(s)")
            meta["by_replica"] = dict(engine.stats().by_replica)
        finally:
            engine.close()
    finally:
        stop_serve()
    return rows


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
