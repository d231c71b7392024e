"""`vlora serve` with replicas: a Ray Serve deployment of engine replicas behind the RPyC front end.

Each replica builds the engine of cfg.engine (adapters of the manifest and extras loaded at
start) on its own GPU, or, with engine.tensor_parallel_size=N, leads a group of N ranks on N GPUs
of its own; the RPyC server drives them through `ReplicatedEngine`, so clients connect
as to one engine. Ray is imported only here.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def start_replicas(cfg: DictConfig, values: dict, checkpoint: Path):
    """Starts (or joins, replicas.ray_address) a Ray cluster, deploys the replicas, returns the
    ReplicatedEngine over them."""
    try:
        from ray import serve

        from serve.distributed.replicas import ReplicatedEngine, build_deployment, start_serve
    except ImportError as e:
        raise SystemExit(f'vlora serve: replicas need Ray Serve (pip install -e ".[ray]"): {e}') from e
    import torch

    r = cfg.replicas
    cuda = values.get("device", "auto") != "cpu" and torch.cuda.is_available()
    if cuda:
        values["device"] = "cuda"  # a replica sees the GPU Ray gave it as the first
    autoscaling = OmegaConf.to_container(r.autoscaling, resolve=True) if r.autoscaling is not None else None
    start_serve(address=r.ray_address)
    # a replica of a tensor-parallel group holds one GPU per rank
    gpus = max(float(r.gpus_per_replica), float(values.get("tensor_parallel_size", 1)))
    actor = {"num_gpus": gpus, "num_cpus": float(r.cpus_per_replica)} if cuda else {"num_cpus": float(r.cpus_per_replica)}
    deployment = build_deployment(str(checkpoint), values, {}, num_replicas=int(r.count),
                                  autoscaling_config=autoscaling, ray_actor_options=actor,
                                  max_ongoing_requests=int(r.capacity or values.get("max_batch_size", 32)),
                                  max_adapters_per_replica=int(r.max_adapters))
    handle = serve.run(deployment, name="vlora", route_prefix=None)
    count = f"{r.count}" if autoscaling is None else f"{autoscaling.get('min_replicas', 1)}-{autoscaling.get('max_replicas')}"
    print(f"vlora serve: {count} replica(s) of {Path(checkpoint).name} on Ray Serve", file=sys.stderr, flush=True)
    return ReplicatedEngine(handle)


def stop_replicas(engine) -> None:
    from serve.distributed.replicas import stop_serve

    engine.close()
    stop_serve()
