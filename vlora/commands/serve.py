"""`vlora serve`: the engine on one checkpoint behind the RPyC service (conf/serve.yaml).

    VLORA_TOKEN=... vlora serve                          # tiny zoo model, 127.0.0.1:18861
    VLORA_TOKEN=... vlora serve model.path=/ckpt rpc.host=0.0.0.0 rpc.port=9000

The server prints `vlora serve: listening on HOST:PORT` once it accepts connections (with
rpc.port=0 the system picks the port) and stops on SIGINT / SIGTERM.

Tensor parallel over N GPUs of one host (serve.distributed): launch N ranks with torchrun,

    VLORA_TOKEN=... torchrun --nproc_per_node N -m vlora.cli serve engine.tensor_parallel_size=N

every rank builds its shard of the engine; rank 0 serves RPyC clients and drives the others.

Replicas on Ray Serve (serve.distributed.replicas; `pip install -e ".[ray]"`), one engine per GPU
behind this RPyC front end, requests routed by adapter:

    VLORA_TOKEN=... vlora serve replicas.count=2                    # a local Ray cluster
    VLORA_TOKEN=... vlora serve replicas.ray_address=auto replicas.autoscaling.max_replicas=8
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from zoo import SPECS, build_checkpoint


def checkpoint_path(model_cfg) -> Path:
    """The model's checkpoint directory; a zoo model that is not built yet is built first."""
    path = Path(model_cfg.path)
    if not path.exists():
        if model_cfg.name not in SPECS:
            raise SystemExit(f"vlora serve: model.path {path} does not exist")
        print(f"vlora serve: building zoo model {model_cfg.name} into {path}", file=sys.stderr, flush=True)
        build_checkpoint(model_cfg.name, path)
    return path


def engine_values(cfg: DictConfig) -> dict:
    """EngineConfig fields of cfg.engine: the policy's settings, the adapters of cfg.adapters (a
    fusion manifest, when it exists, and any extra PEFT directories) to load at start."""
    values = {**OmegaConf.to_container(cfg.engine, resolve=True), "dtype": cfg.model.dtype}
    policy = values.get("policy")
    if isinstance(policy, str) and policy != "fcfs":  # the policy's settings from conf/orchestrator/<name>.yaml
        from ..config import CONF_DIR

        group = Path(CONF_DIR) / "orchestrator" / f"{policy}.yaml"
        if not group.is_file():
            raise SystemExit(f"engine.policy={policy!r}: no {group}; policies: "
                             f"{sorted(p.stem for p in group.parent.glob('*.yaml'))}")
        values["policy"] = OmegaConf.to_container(OmegaConf.load(group), resolve=True)
    manifest = Path(cfg.adapters.manifest)
    if manifest.exists():
        values["adapter_manifest"] = str(manifest)
    if cfg.adapters.extra:
        values["adapters"] = tuple(cfg.adapters.extra)
    return values


def build_engine(cfg: DictConfig):
    """The engine of cfg.model / cfg.engine with cfg.adapters loaded at start."""
    from serve.engine import Engine, EngineConfig

    engine = Engine(checkpoint_path(cfg.model), EngineConfig.from_dict(engine_values(cfg)))
    names = [a["name"] for a in engine.list_adapters()]
    print(f"vlora serve: {cfg.model.name} with {len(names)} adapter(s){': ' + ', '.join(names) if names else ''}",
          file=sys.stderr, flush=True)
    return engine


def start_server(cfg: DictConfig, token: str, connections: int = 0):
    """An in-process RPyC server over build_engine(cfg) on a free loopback port (applications' own server)."""
    from serve.rpc import Limits, RpcServer

    limits = Limits.from_dict(OmegaConf.to_container(cfg.rpc, resolve=True))
    return RpcServer(build_engine(cfg), token, "127.0.0.1", 0, limits,
                     max(connections, int(cfg.rpc.max_connections))).start()


def _join_tensor_parallel(cfg: DictConfig) -> int:
    """Joins the torchrun group of engine.tensor_parallel_size ranks; returns this rank. Each rank
    takes GPU LOCAL_RANK (gloo on CPU)."""
    import os

    import torch
    import torch.distributed as dist

    from serve.distributed import join_group

    size = int(cfg.engine.tensor_parallel_size)
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", 1)) != size:
        raise SystemExit(f"vlora serve: engine.tensor_parallel_size={size} needs {size} ranks started by torchrun "
                         f"(torchrun --nproc_per_node {size} -m vlora.cli serve ...)")
    cuda = cfg.engine.device != "cpu" and torch.cuda.is_available()
    cfg.engine.device = join_group("cuda" if cuda else "cpu", int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank()


def run(cfg: DictConfig):
    from serve.rpc import Limits, RpcServer

    rpc = cfg.rpc
    if not rpc.token:
        raise SystemExit("vlora serve: no token; set VLORA_TOKEN (or rpc.token=...) to a secret of 8+ characters")
    limits = Limits.from_dict(OmegaConf.to_container(rpc, resolve=True))
    tensor_parallel = int(cfg.engine.get("tensor_parallel_size", 1)) > 1
    replicated = "replicas" in cfg and (int(cfg.replicas.count) > 1 or cfg.replicas.autoscaling is not None)
    if replicated:  # with tensor parallel too: each replica leads a group over its GPUs (no torchrun)
        tensor_parallel = False
    rank = _join_tensor_parallel(cfg) if tensor_parallel else 0
    if replicated:
        from .serve_replicas import start_replicas

        engine = start_replicas(cfg, engine_values(cfg), checkpoint_path(cfg.model))
    else:
        engine = build_engine(cfg)
    if tensor_parallel:
        from serve.distributed import LeaderEngine, follow, leave_group

        if rank != 0:  # the other ranks run what rank 0 sends until it closes
            follow(engine)
            leave_group(engine)
            return
        engine = LeaderEngine(engine)
    server = RpcServer(engine, str(rpc.token), rpc.host, int(rpc.port), limits, int(rpc.max_connections))
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    try:
        server.serve_forever(ready=lambda: print(f"vlora serve: listening on {server.host}:{server.port}", flush=True))
    except KeyboardInterrupt:
        server.close()
    finally:
        if tensor_parallel:  # the leader releases its followers, then the group ends together
            engine.close()
            leave_group(engine)
        if replicated:
            from .serve_replicas import stop_replicas

            stop_replicas(engine)
