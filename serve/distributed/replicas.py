"""Engine replicas on Ray Serve, routed by adapter, behind the same RPyC front end.

    deployment = build_deployment(checkpoint, engine_config, adapters, num_replicas=2)
    handle = ray.serve.run(deployment, name="vlora")
    engine = ReplicatedEngine(handle)              # the Engine API the RPC server drives
    server = RpcServer(engine, token, ...)

Each replica (`EngineReplica`) is one Engine (one GPU, or one tensor-parallel group's leader)
running on its own thread (serve.rpc.EngineLoop), so the requests a replica receives at the
same time are batched together. Adapters are Ray Serve's multiplexed models: a request names
its adapter as `multiplexed_model_id`, Ray's router sends it to a replica that already holds
that adapter when there is one, and a replica loads an adapter on first use and unloads its
least recently used one past four. Scaling (`autoscaling_config`) is Ray
Serve's autoscaler: replicas are added as ongoing requests per replica pass its target and
removed when idle.

`ReplicatedEngine` adapts the deployment handle to the step-based Engine API the RPC server's
loop drives: `add_request` sends the request, `step` returns the outputs that arrived (final
outputs only: no token streaming across replicas), and a request whose replica failed (killed,
crashed) is sent again, up to `retries` times, to whichever replica Ray routes it to.
Ray is imported here only: a single-GPU server runs without it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve

from serve.engine import EngineConfig, RequestMetrics, RequestOutput


class EngineReplica:
    """One engine; adapters load on demand through Ray Serve's multiplexing."""

    def __init__(self, checkpoint: str, engine_config: dict, adapters: dict[str, str]):
        from serve.engine import Engine
        from serve.rpc.loop import EngineLoop

        self.engine = Engine(checkpoint, EngineConfig.from_dict(engine_config))
        self.adapters = dict(adapters)  # name -> PEFT directory this replica may load
        self.loop = EngineLoop(self.engine).start()
        self.replica = serve.get_replica_context().replica_id.unique_id

    @serve.multiplexed(max_num_models_per_replica=4)
    async def adapter(self, name: str) -> "_Loaded":
        if name not in self.adapters:
            raise ValueError(f"adapter {name!r} is not served; served: {sorted(self.adapters)}")
        path = self.adapters[name]
        await asyncio.to_thread(self.loop.call, lambda e: e.load_adapter(name, path))
        return _Loaded(self.loop, name)

    async def generate(self, request) -> dict[str, Any]:
        """The request's final event (serve.rpc.loop's format) plus this replica's id."""
        from serve.rpc.loop import Ticket

        name = serve.get_multiplexed_model_id()
        if name:
            await self.adapter(name)
            request.adapter = name
        ticket = Ticket(request.request_id or f"ray-{id(request)}", owner="ray")
        request.request_id = ticket.request_id
        self.loop.submit(request, ticket)
        await asyncio.to_thread(ticket.finished.wait)
        events = ticket.take(0.0)
        final = next(e for e in reversed(events) if e["type"] in ("final", "error"))
        return {**final, "replica": self.replica}

    def adapters_loaded(self) -> list[str]:
        return [a["name"] for a in self.loop.call(lambda e: e.list_adapters())]


class _Loaded:
    """A multiplexed adapter; Ray drops it (LRU) past the replica's limit, which unloads it."""

    def __init__(self, loop, name: str):
        self.loop, self.name = loop, name

    def __del__(self):
        try:
            self.loop.call(lambda e: e.unload_adapter(self.name), timeout=5.0)
        except Exception:  # still referenced by running requests, or the replica is going away
            pass


def build_deployment(checkpoint: str, engine_config: dict, adapters: dict[str, str], num_replicas: int = 1,
                     autoscaling_config: dict | None = None, ray_actor_options: dict | None = None):
    """A bound Ray Serve application of `EngineReplica` (give it to `ray.serve.run`); each replica
    keeps at most 4 adapters loaded (Ray's multiplexing LRU)."""
    cls = EngineReplica
    options = dict(ray_actor_options=ray_actor_options or {"num_cpus": 0}, max_ongoing_requests=256)
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas
    return serve.deployment(cls, **options).bind(checkpoint, engine_config, adapters)


@dataclass
class _Pending:
    request: Any
    response: Any
    arrival: float
    tries: int = 1


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


class ReplicatedEngine:
    """The Engine API over a deployment handle, for serve.rpc's loop (one thread calls it)."""

    def __init__(self, handle, retries: int = 2, poll_s: float = 0.01):
        self.handle, self.retries, self.poll_s = handle, retries, poll_s
        self._pending: dict[str, _Pending] = {}
        self._ids = itertools.count()
        self._stats = ReplicatedStats()
        self.routes: dict[str, str] = {}  # request id -> replica that answered

    def _send(self, request):
        return self.handle.options(multiplexed_model_id=request.adapter or "").generate.remote(request)

    def add_request(self, request, prepared=None) -> str:
        request.request_id = request.request_id or f"req-{next(self._ids)}"
        if request.request_id in self._pending:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        self._pending[request.request_id] = _Pending(request, self._send(request), time.perf_counter())
        return request.request_id

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def abort(self, request_id: str) -> bool:
        p = self._pending.pop(request_id, None)
        if p is not None:
            p.response.cancel()
        return p is not None

    def step(self) -> list[RequestOutput]:
        if not self._pending:
            return []
        refs = {p.response._to_object_ref_sync(): rid for rid, p in self._pending.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.poll_s)
        outputs = []
        for ref in ready:
            rid = refs[ref]
            p = self._pending[rid]
            try:
                final = ray.get(ref)
            except Exception as e:  # the replica died or failed: send it again, elsewhere if Ray can
                if p.tries <= self.retries:
                    p.tries += 1
                    p.response = self._send(p.request)
                    self._stats.retried += 1
                    continue
                final = {"type": "error", "error": {"type": "replica", "message": f"{type(e).__name__}: {e}"}}
                self._stats.failed += 1
            del self._pending[rid]
            outputs.append(self._output(rid, p, final))
        return outputs

    def _output(self, rid: str, p: _Pending, final: dict) -> RequestOutput:
        replica = final.get("replica")
        if replica:
            self.routes[rid] = replica
            self._stats.by_replica[replica] = self._stats.by_replica.get(replica, 0) + 1
        self._stats.finished += 1
        now = time.perf_counter()
        timing = final.get("timing") or {}
        metrics = RequestMetrics(p.arrival, int(timing.get("prompt_tokens") or 0), finished_time=now)
        if final["type"] == "error":
            return RequestOutput(rid, [], "", [], "", True, "error", metrics)
        return RequestOutput(rid, list(final["token_ids"]), final.get("new_text", final["text"]),
                             list(final["token_ids"]), final["text"], True, final["finish_reason"], metrics,
                             head=final.get("head"))

    def stats(self) -> ReplicatedStats:
        self._stats.in_flight = len(self._pending)
        return self._stats

    def list_adapters(self) -> list:
        return []
