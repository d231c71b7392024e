"""What all connections of one server share: the engine's loop, the limits, the tenants, and what
each tenant holds now (connections, requests, decoded pixels), checked against its quotas."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from operator import methodcaller
from typing import Any

from .tenants import Tenant, TenantRegistry
from .wire import Limits, RequestError


def listed_names(engine) -> list[str]:
    """The names of the engine's adapters (module-level: it may run in the engine's own process)."""
    return [a["name"] for a in engine.list_adapters()]


@dataclass
class Usage:
    """One tenant's share of the server at this moment."""

    connections: int = 0
    queued: int = 0  # requests submitted and not finished
    pixels: int = 0


def _once(fn):
    """`fn` made idempotent: a release called twice (finish, then disconnect) gives back once."""
    done = []

    def release() -> None:
        if not done:
            done.append(True)
            fn()

    return release


ADMITTED_S = 10.0  # how long a connection admitted at its handshake holds its place before its service counts it


@dataclass
class ServerState:
    loop: Any  # EngineLoop, or EngineProcess (the engine in a process of its own)
    limits: Limits
    max_connections: int = 64
    tenants: TenantRegistry | None = None
    started: float = field(default_factory=time.time)
    connections: int = 0
    counters: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ids: Any = field(default_factory=itertools.count)
    pixels_in_flight: int = 0  # decoded frame pixels of the requests the server holds, all connections
    usage: dict[str, Usage] = field(default_factory=dict)
    # the engine's adapter names, kept by the service (loads and unloads go through it), so that a
    # request's adapter resolves without a round trip to the engine's thread
    adapter_names: set[str] | None = None
    # counters kept outside the service (the door's sockets, idle closes): () -> {name: count}
    door_counters: Any = None
    # tenant -> its calls' turns at the gate in every front-end process (serve/rpc/gate.py tenant_metrics)
    tenant_gates: Any = None
    # the decoded-pixel budget shared by the server's front-end processes (serve/rpc/tenant_processes.py):
    # a multiprocessing.Value("q") counting every process's pixels in flight; None: this process's alone
    pixel_pool: Any = None
    # (monotonic time, tenant name) of connections admitted at the handshake and not yet connected: they hold
    # their place, or a tenant's connections opened one after another all passed `admit` before the first's
    # service counted itself (a third connection past a quota of two, on a loaded machine)
    admitted: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if hasattr(self.loop, "on_adapters_changed"):  # another front end loaded or unloaded one
            self.loop.on_adapters_changed = self._adapters_changed

    def _adapters_changed(self) -> None:
        self.adapter_names = None  # asked of the engine again at the next use

    def _usage(self, tenant: Tenant) -> Usage:
        return self.usage.setdefault(tenant.name, Usage())

    # ---- connections -----------------------------------------------------------------------------
    def admit(self, tenant: Tenant | None = None) -> bool:
        """Whether one more connection fits, in the server and in the tenant's quota; if it does, its place
        is held until `connected` counts it (or ADMITTED_S passes: a client gone before its service started)."""
        with self.lock:
            now = time.monotonic()
            self.admitted = [a for a in self.admitted if now - a[0] < ADMITTED_S]
            if self.connections + len(self.admitted) >= self.max_connections:
                return False
            name = None if tenant is None else tenant.name
            if tenant is not None:
                waiting = sum(1 for _, who in self.admitted if who == name)
                if self._usage(tenant).connections + waiting >= tenant.quotas.connections:
                    self.counters["refused_tenant_connections"] += 1
                    return False
            self.admitted.append((now, name))
            return True

    def connected(self, tenant: Tenant) -> None:
        with self.lock:
            mine = next((i for i, a in enumerate(self.admitted) if a[1] in (tenant.name, None)), None)
            if mine is not None:
                del self.admitted[mine]
            self.connections += 1
            self._usage(tenant).connections += 1
            self.counters["connections_total"] += 1

    def disconnected(self, tenant: Tenant) -> None:
        with self.lock:
            self.connections -= 1
            self._usage(tenant).connections -= 1

    # ---- requests --------------------------------------------------------------------------------
    def take_queue_slot(self, tenant: Tenant):
        """One request of `tenant` held by the server; returns its release. Over the tenant's quota
        the request is refused (retryable), whichever of its connections sent it."""
        with self.lock:
            usage = self._usage(tenant)
            if usage.queued >= tenant.quotas.queued:
                self.counters["errors_tenant_queued"] += 1
                raise RequestError("too_many_requests", f"{usage.queued} requests of this tenant are in flight "
                                                        f"(its limit {tenant.quotas.queued}); retry when some finish")
            usage.queued += 1

        def release() -> None:
            with self.lock:
                usage.queued -= 1

        return _once(release)

    def reserve_pixels(self, pixels: int, tenant: Tenant | None = None):
        """Takes `pixels` from the server-wide budget of decoded frames and from the tenant's; returns the
        release (idempotent). Over either budget the request is refused as busy (retryable), never
        queued in memory."""
        with self.lock:
            usage = self._usage(tenant) if tenant is not None else None
            if usage is not None and usage.pixels and usage.pixels + pixels > tenant.quotas.pixels:
                self.counters["errors_tenant_pixels"] += 1
                raise RequestError("busy", f"this tenant's requests in flight hold {usage.pixels} decoded pixels, "
                                           f"its limit {tenant.quotas.pixels}; retry shortly")
            held = self._take_from_pool(pixels)
            if held is not None:
                self.counters["errors_busy_pixels"] += 1
                raise RequestError("busy", f"the server holds {held} decoded pixels of requests in flight, its limit; "
                                           "retry shortly")
            self.pixels_in_flight += pixels
            if usage is not None:
                usage.pixels += pixels

        def release() -> None:
            with self.lock:
                self.pixels_in_flight -= pixels
                if usage is not None:
                    usage.pixels -= pixels
            if self.pixel_pool is not None:
                with self.pixel_pool.get_lock():
                    self.pixel_pool.value -= pixels

        return _once(release)

    def _take_from_pool(self, pixels: int) -> int | None:
        """Takes `pixels` from the server-wide budget; None when taken, else what is held (over the limit).
        The first request of an empty budget always fits (one frame may be larger than the budget)."""
        pool = self.pixel_pool
        if pool is None:
            held = self.pixels_in_flight
            return held if held and held + pixels > self.limits.max_pixels_in_flight else None
        with pool.get_lock():
            held = pool.value
            if held and held + pixels > self.limits.max_pixels_in_flight:
                return held
            pool.value = held + pixels
        return None

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counters[key] += n

    # ---- adapters --------------------------------------------------------------------------------
    def loaded_adapters(self, refresh: bool = False) -> set[str]:
        """The engine's adapter names (asked of the engine's thread once, then kept up to date)."""
        if self.adapter_names is None or refresh:
            engine = self.loop.engine
            if hasattr(engine, "adapter_names"):  # replicas: the names they serve, loaded on demand
                names = self.loop.call(methodcaller("adapter_names"))
            elif hasattr(engine, "list_adapters"):
                names = self.loop.call(listed_names)
            else:
                names = []
            self.adapter_names = set(names)
        return self.adapter_names

    def with_adapters(self, fn):
        """fn(adapter names) against the names kept here; when it answers unknown_adapter (an adapter
        loaded by another path since), once more against the engine's own."""
        try:
            return fn(self.loaded_adapters())
        except RequestError as e:
            if e.kind != "unknown_adapter":
                raise
            return fn(self.loaded_adapters(refresh=True))
