"""`vlora serve`: the engine on one checkpoint behind the RPyC service (conf/serve.yaml).

    VLORA_TOKEN=... vlora serve                          # tiny zoo model, 127.0.0.1:18861
    VLORA_TOKEN=... vlora serve model.path=/ckpt rpc.host=0.0.0.0 rpc.port=9000

The server prints `vlora serve: listening on HOST:PORT` once it accepts connections (with
rpc.port=0 the system picks the port) and stops on SIGINT / SIGTERM.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..zoo import SPECS, build_checkpoint


def checkpoint_path(model_cfg) -> Path:
    """The model's checkpoint directory; a zoo model that is not built yet is built first."""
    path = Path(model_cfg.path)
    if not path.exists():
        if model_cfg.name not in SPECS:
            raise SystemExit(f"vlora serve: model.path {path} does not exist")
        print(f"vlora serve: building zoo model {model_cfg.name} into {path}", file=sys.stderr, flush=True)
        build_checkpoint(model_cfg.name, path)
    return path


def build_engine(cfg: DictConfig):
    """The engine of cfg.model / cfg.engine with the adapters of cfg.adapters (a fusion manifest,
    when it exists, and any extra PEFT directories) loaded at start."""
    from serve.engine import Engine, EngineConfig

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
    engine = Engine(checkpoint_path(cfg.model), EngineConfig.from_dict(values))
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


def run(cfg: DictConfig):
    from serve.rpc import Limits, RpcServer

    rpc = cfg.rpc
    if not rpc.token:
        raise SystemExit("vlora serve: no token; set VLORA_TOKEN (or rpc.token=...) to a secret of 8+ characters")
    limits = Limits.from_dict(OmegaConf.to_container(rpc, resolve=True))
    server = RpcServer(build_engine(cfg), str(rpc.token), rpc.host, int(rpc.port), limits, int(rpc.max_connections))
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    try:
        server.serve_forever(ready=lambda: print(f"vlora serve: listening on {server.host}:{server.port}", flush=True))
    except KeyboardInterrupt:
        server.close()
