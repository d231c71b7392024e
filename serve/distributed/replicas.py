"""Engine replicas on Ray Serve, routed by adapter, behind the same RPyC front end.

    deployment = build_deployment(checkpoint, engine_config, adapters, num_replicas=2)
    handle = ray.serve.run(deployment, name="vlora")
    engine = ReplicatedEngine(handle)              # the Engine API the RPC server drives
    server = RpcServer(engine, token, ...)

Each replica (`EngineReplica`) is one Engine (one GPU, or the leader of a tensor-parallel group
over the replica's GPUs, whose other ranks it starts: serve.distributed.local_group) running on
its own thread (serve.rpc.EngineLoop), so the requests a replica receives at the
same time are batched together. Adapters are Ray Serve's multiplexed models: a request names
its adapter as `multiplexed_model_id`, Ray's router sends it to a replica that already holds
that adapter when there is one, and a replica loads an adapter on first use and unloads its
least recently used one past `max_adapters_per_replica`.

Consolidation, Punica's way: a replica takes at most `max_ongoing_requests` requests (give it the
engine's batch size). Ray's router fills the replicas that hold a request's adapter up to that
cap, and only when they are full does it send the request to the replica holding the fewest
adapters, which loads it; when every replica is full, requests wait in the router. Replicas are
added and removed by Ray Serve's autoscaler (`autoscaling_config`): woken as ongoing requests per
replica pass its target, removed once idle past its downscale delay.

`ReplicatedEngine` adapts the deployment handle to the step-based Engine API the RPC server's
loop drives: `add_request` sends the request, `step` returns the outputs that arrived (final
outputs only: no token streaming across replicas), and a request whose replica failed (killed,
crashed) is sent again, up to `retries` times, to whichever replica Ray routes it to. Responses
are awaited on a thread of its own, so a request waiting in the router for a free replica does
not hold up the outputs of the others.
Ray is imported here only: a single-GPU server runs without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray import serve

from serve.engine import EngineConfig, RequestMetrics, RequestOutput


def start_serve(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None,
                env: dict[str, str] | None = None) -> None:
    """Starts a local Ray cluster (address None) or joins one, then Ray Serve without its HTTP proxy
    (clients come in through the RPyC front end). Ray's workers get this process's PYTHONPATH,
    VLORA_HOME and OMP_NUM_THREADS, overridden by `env`."""
    env = {**{k: os.environ[k] for k in ("PYTHONPATH", "VLORA_HOME", "OMP_NUM_THREADS") if k in os.environ},
           **(env or {})}
    # Ray waits 30 s for its control store (GCS) to start; on a busy two-core host, with a previous
    # cluster's processes still exiting, that was seen to run out. An operator's setting wins.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
    for attempt in (1, 2):
        try:
            ray.init(address=address, num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                     logging_level="ERROR", log_to_driver=False, runtime_env={"env_vars": env})
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception when its node misses its start
            # A local control store that never published its port, or a raylet that did not register
            # within Ray's fixed 30 s (each seen once on a loaded two-core host, with nothing in its
            # logs), is started again once, in a new session; joining a cluster, or any other failure,
            # is reported as it is.
            slow_start = any(m in str(e) for m in ("Timed out waiting for file", "timed out during startup"))
            if attempt == 2 or address is not None or not slow_start:
                raise
            logging.getLogger(__name__).warning("Ray's control store did not start (%s); starting it again", e)
            ray.shutdown()
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.start(proxy_location="Disabled")


def stop_serve() -> None:
    serve.shutdown()
    ray.shutdown()


class EngineReplica:
    """One engine; adapters load on demand through Ray Serve's multiplexing (`adapter`, added by
    `build_deployment` with the replica's adapter limit)."""

    def __init__(self, checkpoint: str, engine_config: dict, adapters: dict[str, str],
                 builder: Callable[[str], tuple[str, dict]] | None = None):
        """builder(device): builds (checkpoint directory, weights) inside the replica, on its own
        GPU, for models that exist only as random weights of a published shape (benchmarks): seven
        billion parameters are quicker to make again than to ship. With tensor_parallel_size N > 1
        in engine_config the replica leads a group of N ranks on its N GPUs (serve.distributed.
        local_group), and builder runs in each rank."""
        from serve.engine import Engine
        from serve.rpc.loop import EngineLoop

        self.group = None
        if int(engine_config.get("tensor_parallel_size", 1)) > 1:
            from .local_group import LocalGroup

            self.group = LocalGroup(checkpoint, engine_config, builder)
            self.engine = self.group.engine
        else:
            config, weights = EngineConfig.from_dict(engine_config), None
            if builder is not None:
                checkpoint, weights = builder(config.device)
            self.engine = Engine(checkpoint, config, weights=weights)
            del weights
        self.adapters = dict(adapters)  # name -> PEFT directory this replica may load
        # loaded at start (config, manifest): served for the replica's life, never unloaded by Ray's LRU
        self.startup = frozenset(a["name"] for a in self.engine.list_adapters())
        self.loads: dict[str, int] = {}  # adapter -> times this replica loaded it (affinity: once each)
        self.loop = EngineLoop(self.engine).start()
        # ready only once warm: Ray routes to a replica as soon as this returns, and a warming engine
        # refuses the adapter loads of requests (a replacement replica lost chunks that way)
        while self.loop.warming is not None:
            time.sleep(0.1)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()  # the machine (Ray node) it runs on

    def adapter_names(self) -> list[str]:
        """Every adapter name this replica serves: those loaded at start and those it loads on demand."""
        return sorted(set(self.adapters) | self.startup)

    async def _load(self, name: str) -> "_Loaded":
        def load(engine):  # an adapter the engine loaded at start (EngineConfig.adapters, a manifest) is there
            loaded = {a["name"] for a in engine.list_adapters()}
            if name in loaded:
                return
            if name not in self.adapters:
                raise ValueError(f"adapter {name!r} is not served; served: {sorted(loaded | set(self.adapters))}")
            engine.load_adapter(name, self.adapters[name])
            self.loads[name] = self.loads.get(name, 0) + 1

        await asyncio.to_thread(self.loop.call, load)
        return _Loaded(self.loop, name, unload=name not in self.startup)

    async def generate(self, request) -> dict[str, Any]:
        """The request's final event (serve.rpc.loop's format), this replica's id and its engine's
        counters (mode steps and switches, for the front end's stats)."""
        from serve.rpc.loop import Ticket

        name = serve.get_multiplexed_model_id()
        if name:
            await self.adapter(name)
            request.adapter = name
        ticket = Ticket(request.request_id or f"ray-{id(request)}", owner="ray")
        request.request_id = ticket.request_id
        try:  # chat template and images here, off the engine's thread, as the RPC server does
            prepared = await asyncio.to_thread(self.engine.prepare, request)
        except (ValueError, TypeError) as e:
            return {"type": "error", "error": {"type": "rejected", "message": str(e)}, "replica": self.replica,
                    "counters": {}}
        final = await _final(ticket, lambda: self.loop.submit(request, ticket, prepared))
        stats = self.engine.stats()  # counters read between steps' updates: a snapshot, good enough for totals
        counters = {"steps_by_mode": dict(stats.steps_by_mode or {}), "mode_switches": stats.mode_switches,
                    "switch_ms_total": stats.switch_ms_total, "adapter_loads": dict(self.loads)}
        return {**final, "replica": self.replica, "node": self.node, "counters": counters}

    def list_adapters(self) -> list[dict]:
        """This replica's adapters (Engine.list_adapters)."""
        return self.loop.call(lambda e: e.list_adapters())

    def __del__(self):
        """Ray Serve's shutdown hook: a group's followers are released and the group ends together."""
        if getattr(self, "group", None) is not None:
            self.loop.stop()  # no step is in flight while the group ends
            self.group.close()
            self.group = None


async def _final(ticket, submit: Callable[[], None]) -> dict:
    """Submits through `submit` and awaits the ticket's final (or error) event on the running event loop.
    No worker thread waits for the engine: one thread a request in flight took the pool (asyncio's
    default executor, ~32 threads) that also prepares new requests, so a replica with more requests in
    flight than threads prepared none until one finished."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def wake() -> None:  # on the engine's thread, once the final event is queued
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    ticket.on_finish = wake
    submit()
    await done
    return next(e for e in reversed(ticket.take(0.0)) if e["type"] in ("final", "error"))


class _Loaded:
    """A multiplexed adapter; Ray drops it (LRU) past the replica's limit, which unloads it
    (unless the replica loaded it at start)."""

    def __init__(self, loop, name: str, unload: bool = True):
        self.loop, self.name, self.unload = loop, name, unload

    def __del__(self):
        if not self.unload:
            return
        try:
            self.loop.call(lambda e: e.unload_adapter(self.name), timeout=5.0)
        except Exception:  # still referenced by running requests, or the replica is going away
            pass


def _replica_class(max_adapters: int) -> type:
    """EngineReplica with Ray's multiplexing limit set (the decorator takes it at class creation)."""

    class Replica(EngineReplica):
        @serve.multiplexed(max_num_models_per_replica=max_adapters)
        async def adapter(self, name: str) -> _Loaded:
            return await self._load(name)

    Replica.__name__ = Replica.__qualname__ = "EngineReplica"
    return Replica


def build_deployment(checkpoint: str, engine_config: dict, adapters: dict[str, str], num_replicas: int = 1,
                     autoscaling_config: dict | None = None, ray_actor_options: dict | None = None,
                     max_ongoing_requests: int = 256, max_adapters_per_replica: int = 4,
                     builder: Callable[[], tuple[str, dict]] | None = None):
    """A bound Ray Serve application of `EngineReplica` (give it to `ray.serve.run`).
    max_ongoing_requests: a replica's capacity (consolidation fills replicas up to it; give it
    the engine's batch size); ray_actor_options: e.g. {"num_gpus": 1} for one GPU a replica."""
    if max_ongoing_requests < 1 or max_adapters_per_replica < 1:
        raise ValueError(f"max_ongoing_requests ({max_ongoing_requests}) and max_adapters_per_replica "
                         f"({max_adapters_per_replica}) must be at least 1")
    options = dict(name="EngineReplica", ray_actor_options=ray_actor_options or {"num_cpus": 0},
                   max_ongoing_requests=max_ongoing_requests)
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas
    cls = _replica_class(max_adapters_per_replica)
    return serve.deployment(cls, **options).bind(checkpoint, engine_config, adapters, builder)


_FIXED_ADAPTERS = ("replicas load adapters on demand from the set given at deployment (build_deployment's "
                   "adapters, or the engine config's manifest); redeploy to change it")


@dataclass
class _Pending:
    request: Any
    arrival: float
    tries: int = 1
    future: Any = None  # concurrent.futures.Future of the awaiting coroutine (cancel aborts)


@dataclass
class ReplicatedStats:
    in_flight: int = 0
    waiting: int = 0
    running: int = 0
    blocks_in_use: int = 0
    finished: int = 0
    retried: int = 0
    failed: int = 0
    by_replica: dict[str, int] = field(default_factory=dict)
    by_node: dict[str, int] = field(default_factory=dict)  # requests answered per Ray node (machine)
    adapter_loads: dict[str, dict[str, int]] = field(default_factory=dict)  # replica -> adapter -> loads
    # the replicas' engine counters summed (each replica's latest report)
    steps_by_mode: dict[str, int] = field(default_factory=dict)
    mode_switches: int = 0
    switch_ms_total: float = 0.0


class ReplicatedEngine:
    """The Engine API over a deployment handle, for serve.rpc's loop (one thread calls it)."""

    def __init__(self, handle, retries: int = 2, poll_s: float = 0.01):
        self.handle, self.retries, self.poll_s = handle, retries, poll_s
        self._pending: dict[str, _Pending] = {}
        self._done: queue.Queue = queue.Queue()  # (request id, try, final event or None, error or None)
        self._ids = itertools.count()
        self._stats = ReplicatedStats()
        self._counters: dict[str, dict] = {}  # replica -> its engine counters, latest
        self.routes: dict[str, str] = {}  # request id -> replica that answered
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="replicated-engine", daemon=True).start()

    def _send(self, rid: str, p: _Pending) -> None:
        response = self.handle.options(multiplexed_model_id=p.request.adapter or "").generate.remote(p.request)
        p.future = asyncio.run_coroutine_threadsafe(self._await(rid, p.tries, response), self._loop)

    async def _await(self, rid: str, tries: int, response) -> None:
        try:
            self._done.put((rid, tries, await response, None))
        except asyncio.CancelledError:
            response.cancel()
            raise
        except Exception as e:  # the replica died or failed
            self._done.put((rid, tries, None, e))

    def add_request(self, request, prepared=None) -> str:
        request.request_id = request.request_id or f"req-{next(self._ids)}"
        if request.request_id in self._pending:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        p = self._pending[request.request_id] = _Pending(request, time.perf_counter())
        self._send(request.request_id, p)
        return request.request_id

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def abort(self, request_id: str) -> bool:
        p = self._pending.pop(request_id, None)
        if p is not None and p.future is not None:
            p.future.cancel()
        return p is not None

    def step(self) -> list[RequestOutput]:
        """The outputs that arrived, waiting up to poll_s for the first."""
        if not self._pending:
            return []
        arrived = []
        try:
            arrived.append(self._done.get(timeout=self.poll_s))
            while True:
                arrived.append(self._done.get_nowait())
        except queue.Empty:
            pass
        outputs = []
        for rid, tries, final, error in arrived:
            p = self._pending.get(rid)
            if p is None or p.tries != tries:  # aborted, or an answer to a try already replaced
                continue
            if error is not None:
                if p.tries <= self.retries:  # send it again, elsewhere if Ray can
                    p.tries += 1
                    self._stats.retried += 1
                    self._send(rid, p)
                    continue
                final = {"type": "error", "error": {"type": "replica", "message": f"{type(error).__name__}: {error}"}}
                self._stats.failed += 1
            del self._pending[rid]
            outputs.append(self._output(rid, p, final))
        return outputs

    def _output(self, rid: str, p: _Pending, final: dict) -> RequestOutput:
        replica = final.get("replica")
        if replica:
            self.routes[rid] = replica
            self._stats.by_replica[replica] = self._stats.by_replica.get(replica, 0) + 1
            node = final.get("node") or "?"
            self._stats.by_node[node] = self._stats.by_node.get(node, 0) + 1
            self._counters[replica] = final.get("counters") or {}
        self._stats.finished += 1
        now = time.perf_counter()
        timing = final.get("timing") or {}
        # the replica's clock is not ours: its prefill and decode durations are placed before our
        # finish time, and everything else (routing, waiting for a free replica, its queue) is queueing
        first_token = now - (timing.get("decode_ms") or 0.0) / 1e3
        first_scheduled = max(p.arrival, first_token - (timing.get("prefill_ms") or 0.0) / 1e3)
        metrics = RequestMetrics(p.arrival, int(timing.get("prompt_tokens") or 0), first_scheduled_time=first_scheduled,
                                 first_token_time=max(first_scheduled, first_token), finished_time=now)
        if final["type"] == "error":
            return RequestOutput(rid, [], "", [], "", True, "error", metrics)
        return RequestOutput(rid, list(final["token_ids"]), final.get("new_text", final["text"]),
                             list(final["token_ids"]), final["text"], True, final["finish_reason"], metrics,
                             head=final.get("head"))

    def stats(self) -> ReplicatedStats:
        s = self._stats
        s.in_flight = len(self._pending)
        s.steps_by_mode = {}
        for c in self._counters.values():
            for mode, n in (c.get("steps_by_mode") or {}).items():
                s.steps_by_mode[mode] = s.steps_by_mode.get(mode, 0) + n
        s.mode_switches = sum(c.get("mode_switches", 0) for c in self._counters.values())
        s.switch_ms_total = sum(c.get("switch_ms_total", 0.0) for c in self._counters.values())
        s.adapter_loads = {r: dict(c.get("adapter_loads") or {}) for r, c in self._counters.items()}
        return dataclasses.replace(s, by_replica=dict(s.by_replica), by_node=dict(s.by_node))  # a snapshot

    def list_adapters(self) -> list[dict]:
        """The adapters of the replica Ray picks (each replica holds those it loaded at start and
        those it was sent since)."""
        return self.handle.list_adapters.remote().result()

    def adapter_names(self) -> list[str]:
        """The adapter names the replicas serve (loaded at start or on a request's demand): what the
        RPC front end resolves a request's adapter against."""
        return self.handle.adapter_names.remote().result()

    def load_adapter(self, name: str, path=None, pin: bool = False):
        raise ValueError(_FIXED_ADAPTERS)

    def unload_adapter(self, name: str, abort: bool = False):
        raise ValueError(_FIXED_ADAPTERS)

    def close(self) -> None:
        """Stops the thread awaiting responses (requests still in flight are dropped)."""
        for rid in list(self._pending):
            self.abort(rid)
        self._loop.call_soon_threadsafe(self._loop.stop)
