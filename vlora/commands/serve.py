"""`vlora serve`: the engine on one checkpoint behind the RPyC service (conf/serve.yaml).

    VLORA_TOKEN=... vlora serve                          # the adapters' base (else the tiny zoo model), 127.0.0.1:18861
    VLORA_TOKEN=... vlora serve model.path=/ckpt rpc.host=0.0.0.0 rpc.port=9000
    VLORA_TOKEN=... vlora serve "adapters.manifest=[.vlora/adapters/fused,.vlora/adapters/color_main]"

Adapters (adapters.manifest): a fusion manifest (file or folder), a `vlora train` adapter
directory, or a list of these (adapters.read_sources). The base model travels with them: with
model.path unset (null) the server loads the base their meta.json / manifest records (name, path,
weights fingerprint), else the zoo model ${paths.zoo}/${model.name}; a model.path whose
fingerprint differs from the adapters' base is refused with both named, unless
adapters.allow_base_mismatch=true. Every value is checked before the model is built: a user
error ends with one line and exit status 1.

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

import errno
import os
import re
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from adapters import AdapterSet, ManifestError, base_identity, describe, read_sources, same_base
from adapters.peft import read_config
from zoo import SPECS, build_checkpoint

from .address import remove_address

DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def fail(message: str):
    """A user error: one line, exit status 1, no traceback."""
    raise SystemExit(f"vlora serve: {message}")


def check_config(cfg: DictConfig, token, listens: bool = True) -> None:
    """Every value a user can get wrong, checked before anything is built (policy, token, device,
    dtype, sizes, model.path, and rpc.port when this process listens on it)."""
    from serve.orchestrator import POLICIES

    from ..config import CONF_DIR

    policy = cfg.engine.get("policy", "fcfs")
    groups = sorted(p.stem for p in (Path(CONF_DIR) / "orchestrator").glob("*.yaml"))
    if isinstance(policy, str) and (policy not in POLICIES or (policy != "fcfs" and policy not in groups)):
        fail(f"engine.policy={policy!r} is not a policy; choose one of {sorted(set(groups) | {'fcfs'})}")
    tenants = cfg.rpc.get("tenants")
    if tenants:
        try:
            from serve.rpc.tenants import parse_tenants

            parse_tenants(Path(str(tenants)).expanduser())
        except (OSError, ValueError) as e:
            fail(f"rpc.tenants: {e}")
    elif not token:
        fail("no token; set VLORA_TOKEN (or rpc.token=...) to a secret of 8+ characters, or give rpc.tenants=<file> "
             "(`vlora tenants add FILE NAME` writes one)")
    elif not isinstance(token, str) or len(token) < 8:
        fail(f"the token is {len(str(token))} characters; the server needs a secret of 8+ characters "
             "(VLORA_TOKEN or rpc.token=...)")
    device = str(cfg.engine.get("device", "auto"))
    if not _DEVICE.match(device):
        fail(f"engine.device={device!r}: use auto, cpu, cuda or cuda:<index>")
    if str(cfg.model.dtype) not in DTYPES:
        fail(f"model.dtype={cfg.model.dtype!r}: use one of {list(DTYPES)}")
    for key in ("tensor_parallel_size", "max_batch_size", "max_tokens_per_step", "kv_block_size"):
        value = cfg.engine.get(key, 1)
        if not isinstance(value, int) or value < 1:
            fail(f"engine.{key}={value!r}: must be an integer >= 1")
    path = cfg.model.get("path")
    if path is not None and not Path(path).expanduser().exists() and cfg.model.name not in SPECS:
        fail(f"model.path {path} does not exist (and model.name={cfg.model.name!r} is no zoo model to build there)")
    if listens:
        check_port(str(cfg.rpc.host), int(cfg.rpc.port))


def check_port(host: str, port: int) -> None:
    """Binds host:port and lets go, so a busy port is answered before the model is built."""
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        fail(f"rpc.host={host!r} cannot be resolved ({e.strerror})")
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind((host, port))
        except OSError as e:
            fail(busy_port(port) if e.errno == errno.EADDRINUSE
                 else f"cannot listen on {host}:{port} ({e.strerror}); check rpc.host")


def busy_port(port: int) -> str:
    return f"port {port} is in use; pass rpc.port=<free port> (or 0 for any free one)"


@dataclass
class ServePlan:
    """What `vlora serve` will load, decided before anything is built."""

    checkpoint: Path
    name: str
    how: str  # why this base: "model.path", "recorded by the adapters", "zoo model ..."
    adapters: AdapterSet
    mismatched: list  # adapters whose recorded base differs (loaded only with allow_base_mismatch)


def plan_serve(cfg: DictConfig, sources=None) -> ServePlan:
    """The base and the adapters of cfg (sources: cfg.adapters.manifest unless given). A base
    recorded by the adapters is loaded unless model.path is given; a mismatch is refused unless
    adapters.allow_base_mismatch=true."""
    sources = cfg.adapters.manifest if sources is None else sources
    if OmegaConf.is_config(sources):
        sources = OmegaConf.to_container(sources, resolve=True)
    try:
        found = read_sources(sources, [str(x) for x in cfg.adapters.get("extra") or ()])
        for e in found.entries:  # a missing directory or an option the server cannot apply, before the build
            read_config(Path(e.path))
    except (ManifestError, ValueError) as e:
        fail(str(e))
    recorded = [e for e in found.entries if e.base]
    zoo = Path(cfg.paths.zoo) / cfg.model.name
    if cfg.model.get("path") is not None:
        checkpoint, how = Path(cfg.model.path).expanduser(), "model.path"
        name = cfg.model.name if checkpoint.resolve() == zoo.resolve() else checkpoint.resolve().name
    elif recorded:
        first = recorded[0]
        other = next((e for e in recorded if same_base(e.base, first.base) is False), None)
        if other is not None:
            fail(f"the adapters record different base models: {first.name} {describe(first.base)} and {other.name} "
                 f"{describe(other.base)}; serve them apart, or pass model.path=<checkpoint> with "
                 "adapters.allow_base_mismatch=true")
        checkpoint, name, how = Path(first.base["path"]), first.base.get("name"), "recorded by the adapters"
        if not checkpoint.exists():
            if checkpoint.name not in SPECS:
                fail(f"the adapters were trained on {describe(first.base)}, which is not here; pass "
                     "model.path=<a copy of that checkpoint>")
            checkpoint = Path(cfg.paths.zoo) / checkpoint.name  # a zoo model: built here, fingerprint checked
    else:
        checkpoint, name = zoo, cfg.model.name
        how = "zoo model, as the adapters record no base" if found.entries else "zoo model, no adapters"
    base = base_identity(checkpoint, name or checkpoint.name)
    plan = ServePlan(checkpoint, base["name"], how, found, [])
    if checkpoint.exists() or how == "model.path":  # by path while a zoo model is not built yet
        _check_bases(cfg, plan, base)
    return plan


def _check_bases(cfg: DictConfig, plan: ServePlan, base: dict) -> None:
    plan.mismatched = [e for e in plan.adapters.entries if same_base(e.base, base) is False]
    if plan.mismatched and not cfg.adapters.get("allow_base_mismatch", False):
        e = plan.mismatched[0]
        more = f" (and {len(plan.mismatched) - 1} more)" if len(plan.mismatched) > 1 else ""
        fail(f"adapter {e.name!r}{more} was trained on base model {describe(e.base)}, but the server would load "
             f"{describe(base)} ({plan.how}); leave model.path unset to load the adapters' base, pass "
             "model.path=<their base>, or adapters.allow_base_mismatch=true to load them anyway")


def checkpoint_of(cfg: DictConfig, plan: ServePlan) -> tuple[Path, dict]:
    """The plan's checkpoint (a zoo model that is not built yet is built first) and its identity."""
    path = plan.checkpoint
    if not path.exists():
        zoo_name = path.name if path.name in SPECS and plan.how != "model.path" else cfg.model.name
        print(f"vlora serve: building zoo model {zoo_name} into {path}", file=sys.stderr, flush=True)
        build_checkpoint(zoo_name, path)
    base = base_identity(path, plan.name)
    _check_bases(cfg, plan, base)
    return path, base


def engine_values(cfg: DictConfig, plan: ServePlan, at_start: bool = True) -> dict:
    """EngineConfig fields of cfg.engine: the policy's settings (conf/orchestrator/<name>.yaml) and,
    when at_start, the plan's adapters to load at start."""
    values = {**OmegaConf.to_container(cfg.engine, resolve=True), "dtype": cfg.model.dtype}
    policy = values.get("policy")
    if isinstance(policy, str) and policy != "fcfs":
        from ..config import CONF_DIR

        values["policy"] = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "orchestrator" / f"{policy}.yaml"),
                                                  resolve=True)
    if at_start and plan.adapters.entries:
        values["adapters"] = tuple(f"{e.name}={e.path}" for e in plan.adapters.entries)
    return values


def _log_start(plan: ServePlan, base: dict, names: list[str], log) -> None:
    print(f"vlora serve: base {describe(base)} ({plan.how}); {len(names)} adapter(s)"
          f"{': ' + ', '.join(names) if names else ''}", file=log, flush=True)
    for source in plan.adapters.missing:
        print(f"vlora serve: no adapters at {source} (nothing written there yet)", file=log, flush=True)
    for e in plan.adapters.entries:
        if not e.has_meta:
            print(f"vlora serve: adapter {e.name} ({e.path}) has no meta.json: its base model is unknown and "
                  "not checked", file=log, flush=True)
    for e in plan.mismatched:
        print(f"vlora serve: adapters.allow_base_mismatch=true: adapter {e.name} was trained on {describe(e.base)}, "
              "loaded anyway", file=log, flush=True)


def build_engine(cfg: DictConfig, plan: ServePlan | None = None):
    """The engine of the plan's base (plan_serve(cfg) unless given) with its adapters loaded."""
    from serve.engine import Engine, EngineConfig

    plan = plan or plan_serve(cfg)
    checkpoint, base = checkpoint_of(cfg, plan)
    late = bool(plan.mismatched)  # loaded after the build, past the engine's own base check
    engine = Engine(checkpoint, EngineConfig.from_dict(engine_values(cfg, plan, at_start=not late)))
    if late:
        for e in plan.adapters.entries:
            engine.load_adapter(e.name, e.path, allow_base_mismatch=True)
    _log_start(plan, base, [a["name"] for a in engine.list_adapters()], sys.stderr)
    return engine


def start_server(cfg: DictConfig, token: str, connections: int = 0, sources=None):
    """An in-process RPyC server over build_engine(cfg) on a free loopback port (applications' own
    server); sources: the adapters to serve (default cfg.adapters.manifest). Checked first."""
    from serve.rpc import Limits, RpcServer

    check_config(cfg, token, listens=False)  # it listens on a free port
    plan = plan_serve(cfg, sources)
    values = OmegaConf.to_container(cfg.rpc, resolve=True)
    values["pace_tenant_processes"] = False  # served in this process: no tenant processes to pace
    limits = Limits.from_dict(values)
    engine = build_engine(cfg, plan)
    if engine.needs_warm_up:  # the app waits for its own server anyway: warm before it listens
        engine.warm_up()
    return RpcServer(engine, token, "127.0.0.1", 0, limits, max(connections, int(cfg.rpc.max_connections))).start()


def identities(cfg: DictConfig):
    """Who may connect: the tenants file (rpc.tenants) when given, else the one token (the operator)."""
    from serve.rpc.tenants import TenantRegistry

    tenants = cfg.rpc.get("tenants")
    if tenants:
        registry = TenantRegistry.from_file(Path(str(tenants)).expanduser())
        print(f"vlora serve: {len(registry.names())} tenant(s) from {registry.path}"
              + ("; rpc.token / VLORA_TOKEN is not used" if cfg.rpc.get("token") else ""), file=sys.stderr, flush=True)
        return registry
    return str(cfg.rpc.token)


def _join_tensor_parallel(cfg: DictConfig) -> int:
    """Joins the torchrun group of engine.tensor_parallel_size ranks; returns this rank. Each rank
    takes GPU LOCAL_RANK (gloo on CPU)."""
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


def _announce(cfg: DictConfig, server) -> Path | None:
    """Writes the address file (before the listening line, so whoever saw that line finds it)."""
    from .address import find_server, write_address

    other = find_server(cfg.paths.home, sys.stderr, "vlora serve")  # a stale file is noted, then written over
    if other is not None:
        print(f"vlora serve: the server at {other} (pid {other.pid}) also uses {cfg.paths.home}; the apps will "
              "find this one", file=sys.stderr, flush=True)
    try:
        return write_address(cfg.paths.home, server.host, server.port)
    except OSError as e:  # serving goes on; only finding it by default does not
        print(f"vlora serve: cannot write the address file in {cfg.paths.home} ({e.strerror or e}); the apps "
              f"reach this server with server.port={server.port}", file=sys.stderr, flush=True)
        return None


def _warm_line(report: dict) -> None:
    if "error" in report:
        print(f"vlora serve: the warm-up failed ({report['error']}); serving cold", file=sys.stderr, flush=True)
        return
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in report.get("phases", {}).items())
    print(f"vlora serve: ready: warmed up in {report['seconds']:.1f} s ({report['requests']} requests, "
          f"{report['steps']} steps: {phases})", flush=True)


def http_config(cfg: DictConfig):
    """The `http:` block as serve.http.HttpConfig, checked (and its packages) before anything is built."""
    from serve.http.config import HttpConfig, missing_packages

    raw = cfg.get("http")
    try:
        http = HttpConfig.from_dict(OmegaConf.to_container(raw, resolve=True) if raw is not None else None)
    except (TypeError, ValueError) as e:
        fail(str(e).removeprefix("HttpConfig.__init__() "))
    if http.enabled:
        missing = missing_packages()
        if missing:
            fail(missing)
        if (str(http.host), http.port) == (str(cfg.rpc.host), int(cfg.rpc.port)) and http.port:
            fail(f"http.port={http.port} is rpc.port too; give the HTTP API a port of its own")
        try:
            check_port(str(http.host), int(http.port))
        except SystemExit as e:  # its line names rpc.*: say it of http.*
            fail(str(e).removeprefix("vlora serve: ").replace("rpc.", "http."))
    return http


def _http_server(server, http, base_model: str):
    from serve.http import HttpServer

    try:
        return HttpServer(server.state, http, base_model)
    except OSError as e:  # taken since check_port
        fail(f"cannot listen on {http.host}:{http.port} for http ({e.strerror or e}); pass http.port=<free port>")


def _tenant_processes(rpc) -> int:
    from serve.rpc.tenant_processes import check_limit

    try:
        return check_limit(rpc.get("tenant_processes", 0))
    except ValueError as e:
        fail(str(e))


def _pacing(rpc, processes: int) -> bool:
    """rpc.pace_tenant_processes resolved (ValueError naming it); with tenants, what the machine made of it is said."""
    from serve.rpc.tenant_processes import check_pacing, usable_cores

    value = rpc.get("pace_tenant_processes", False)
    paced = check_pacing(value, processes)
    if rpc.get("tenants") and processes and "auto" in (value, rpc.get("tenant_processes")):
        print(f"vlora serve: up to {processes} tenant front-end process(es), {'paced' if paced else 'not paced'}"
              f" against each other, on {usable_cores()} usable cores", file=sys.stderr, flush=True)
    return paced


def _switch_interval(rpc, key: str) -> float | None:
    value = rpc.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1000):
        fail(f"rpc.{key}={value!r}: give milliseconds in (0, 1000], or null for Python's default")
    return None if value is None else float(value)


def engine_threads(cfg: DictConfig) -> int | None:
    """rpc.engine_threads resolved: torch threads for the process that steps a CPU engine, or None where torch's
    default stands (a GPU engine, or OMP_NUM_THREADS set). `auto` leaves a core to the front end: with every core
    the engine's workers wait for the one a busy front end holds, and that wait is CPU time too. In one process
    on 2 cores, an 8-sequence decode step took 15.6 ms at two threads with the other core busy against 5.6-6.5
    idle; at one thread 5.9-8.1 either way (results/soak/cpu/engine_threads)."""
    from serve.engine.engine import resolve_device
    from serve.rpc.tenant_processes import usable_cores

    value = cfg.rpc.get("engine_threads", "auto")
    if value == "auto":
        try:
            on_cpu = resolve_device(str(cfg.engine.device)).type == "cpu"
        except (ValueError, RuntimeError):  # the engine's build says what is wrong with the device
            return None
        if not on_cpu or os.environ.get("OMP_NUM_THREADS"):
            return None
        return max(1, usable_cores() - 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        fail(f"rpc.engine_threads={value!r}: give a whole number of threads (1 or more), or auto")
    return value


def _build_in_engine_process(cfg: DictConfig, plan: ServePlan, switch_ms: float | None, threads: int | None = None):
    """build_engine, run in the engine's own process; switch_ms: that process's interpreter switch interval,
    how long the step loop may wait for the interpreter while a thread reading or writing the pipes holds it;
    threads: its torch threads (engine_threads)."""
    if switch_ms is not None:
        sys.setswitchinterval(switch_ms / 1e3)
    _step_threads(threads)
    return build_engine(cfg, plan)


def _step_threads(threads: int | None) -> None:
    """Gives torch `threads` threads in the process about to step a CPU engine (None: torch's default stands)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def run(cfg: DictConfig):
    from serve.rpc import Limits, RpcServer

    rpc = cfg.rpc
    check_config(cfg, rpc.token, listens=int(os.environ.get("RANK", 0)) == 0)  # tensor parallel: rank 0 serves
    switch_ms = _switch_interval(rpc, "switch_interval_ms")
    if switch_ms is not None:  # how soon a thread woken by an answer gets the interpreter from a busy one
        sys.setswitchinterval(switch_ms / 1e3)
    engine_switch_ms = _switch_interval(rpc, "engine_switch_interval_ms")
    threads = engine_threads(cfg)
    http = http_config(cfg) if int(os.environ.get("RANK", 0)) == 0 else None
    plan = plan_serve(cfg)
    processes = _tenant_processes(rpc)  # checked before the engine is built
    values = OmegaConf.to_container(rpc, resolve=True)
    try:
        values["pace_tenant_processes"] = _pacing(rpc, processes)
        limits = Limits.from_dict(values)
    except ValueError as e:  # a limit out of its range: said before anything is built
        fail(str(e))
    tensor_parallel = int(cfg.engine.get("tensor_parallel_size", 1)) > 1
    replicated = "replicas" in cfg and (int(cfg.replicas.count) > 1 or cfg.replicas.autoscaling is not None)
    if replicated:  # with tensor parallel too: each replica leads a group over its GPUs (no torchrun)
        tensor_parallel = False
    rank = _join_tensor_parallel(cfg) if tensor_parallel else 0
    if replicated:
        from .serve_replicas import start_replicas

        if plan.mismatched:
            fail("adapters.allow_base_mismatch=true is not available with replicas; serve with replicas.count=1")
        checkpoint, base = checkpoint_of(cfg, plan)
        _log_start(plan, base, [e.name for e in plan.adapters.entries], sys.stderr)
        engine = start_replicas(cfg, engine_values(cfg, plan), checkpoint)
    elif not tensor_parallel and cfg.rpc.get("engine_process", True):
        from functools import partial

        from serve.rpc import EngineProcess

        # the step loop in a process of its own: no client's traffic takes its interpreter (serve.rpc.engine_host);
        # attachable by the tenants' own front-end processes (serve.rpc.tenant_processes)
        engine = EngineProcess(partial(_build_in_engine_process, cfg, plan, engine_switch_ms, threads),
                               attachable=bool(rpc.get("tenants")) and processes > 0).start()
    else:
        if not tensor_parallel:  # its steps run on a thread of this process
            _step_threads(threads)
        engine = build_engine(cfg, plan)
    if tensor_parallel:
        from serve.distributed import LeaderEngine, follow, leave_group

        if rank != 0:  # the other ranks run what rank 0 sends until it closes
            follow(engine)
            leave_group(engine)
            return
        engine = LeaderEngine(engine)
    try:
        server = RpcServer(engine, identities(cfg), rpc.host, int(rpc.port), limits, int(rpc.max_connections),
                           freeze=bool(rpc.get("freeze_heap", True)), tenant_processes=processes)
    except OSError as e:  # taken since check_port
        fail(busy_port(int(rpc.port)) if e.errno == errno.EADDRINUSE
             else f"cannot listen on {rpc.host}:{rpc.port} ({e})")
    signal.signal(signal.SIGTERM, lambda *_: server.close())
    address = []  # the address file the apps find this server by (vlora.commands.address), once listening
    front = _http_server(server, http, plan.name) if http is not None and http.enabled else None

    def ready():
        address.append(_announce(cfg, server))
        if front is not None:  # the OpenAI-compatible API over the same state (serve.http)
            front.start()
            print(f"vlora serve: HTTP (OpenAI API) on http://{front.host}:{front.port}/v1", flush=True)
        print(f"vlora serve: listening on {server.host}:{server.port}", flush=True)
        if server.loop.warming is not None:
            print("vlora serve: warming the engine up before it takes work (health says state 'warming'; "
                  "engine.warm_up=off skips it)", flush=True)
            server.loop.when_warm(_warm_line)

    try:
        server.serve_forever(ready=ready)
    except KeyboardInterrupt:
        server.close()
    finally:
        if front is not None:
            front.close()
        if address:
            remove_address(address[0], server.port)
        if tensor_parallel:  # the leader releases its followers, then the group ends together
            engine.close()
            leave_group(engine)
        if replicated:
            from .serve_replicas import stop_replicas

            stop_replicas(engine)
