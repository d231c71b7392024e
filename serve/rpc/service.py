"""The RPyC service: the server's only surface. One instance per connection.

Every exposed method takes plain values and returns one JSON string, `{"ok": true, ...}` or
`{"ok": false, "error": {"type": ..., "message": ...}}`: no object of the server is ever handed
out by reference and no exception object crosses the wire, so a client can neither walk into
the server's attributes nor make it run client code. Nothing a client sends can stop the engine
thread; a client's own requests are aborted when it disconnects.

Each connection acts for the tenant whose token it sent (serve.rpc.tenants): its requests count
against that tenant's quotas, and it sees, uses and unloads adapters as serve.rpc.ownership says.
A tenant removed from the tenants file, or given a new token, is cut off at its next call.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections import deque
from operator import methodcaller

import rpyc

from . import ownership
from .adapter_calls import AdapterCalls
from .gate import GATE
from .loop import Ticket
from .metrics import prometheus_text
from .replies import guarded, reply
from .state import ServerState
from .tenants import Tenant
from .wire import RequestError, parse_submission

log = logging.getLogger("vlora.serve.rpc")
MAX_POLL_S = 5.0
REQUEST_ID = re.compile(r"c[0-9]{1,12}-[0-9]{1,12}")


def _shown(request_id) -> str:
    """A request id as an error may repeat it: only ids of the server's own form; never what a
    client sent otherwise (a 63 MB string would come back as a 63 MB reply)."""
    return repr(request_id) if type(request_id) is str and REQUEST_ID.fullmatch(request_id) else "with that id"


class VLoRAService(AdapterCalls, rpyc.Service):
    def __init__(self, state: ServerState):
        self.state = state
        self.conn_id = f"c{next(state.ids)}"
        self._tickets: dict[str, Ticket] = {}
        self._expired: deque[str] = deque(maxlen=1024)  # results forgotten unpolled, to say so when asked
        self._n = itertools.count()
        self._connected = False
        self._conn = None
        self.tenant: Tenant | None = None

    def on_connect(self, conn) -> None:
        tenant = conn._config.get("credentials")
        if not isinstance(tenant, Tenant):  # a server built without the token check: one operator
            from .tenants import sole_operator

            tenant = sole_operator()
        self.tenant, self._conn = tenant, conn
        self.state.connected(tenant)
        self._connected = True

    def _who(self) -> Tenant:
        """This connection's tenant as the registry knows it now (quotas may have been reloaded)."""
        registry = self.state.tenants
        if registry is None or registry.path is None:
            return self.tenant
        now = registry.current(self.tenant)
        if now is None:
            self.state.count("revoked_calls")
            conn = self._conn
            if conn is not None:  # after this reply is sent: closing inside the call would lose it
                threading.Timer(0.05, conn.close).start()
            raise RequestError("unauthorized", "this connection's token is no longer valid (its tenant was removed "
                                               "or given a new token); reconnect with the current one")
        return now

    def on_disconnect(self, conn) -> None:
        if not self._connected:
            return
        self._connected = False
        for request_id, ticket in list(self._tickets.items()):
            if not ticket.finished.is_set():
                self.state.loop.abort(request_id)  # its KV blocks and slot go back to the engine
                self.state.count("aborted_on_disconnect")
        self._tickets.clear()
        self.state.disconnected(self.tenant)

    # ---- requests ------------------------------------------------------------------------------
    def _expire(self) -> None:
        """Forgets finished results nobody polled: past the time limit, then the oldest past the count.
        A connection that never polls cannot make the server keep its results without bound."""
        limits = self.state.limits
        done = sorted((t.finished_at, rid) for rid, t in self._tickets.items() if t.finished_at is not None)
        keep = limits.max_unpolled_per_connection or limits.max_queued_per_connection
        cutoff = time.monotonic() - limits.result_ttl_s
        for i, (at, rid) in enumerate(done):
            if at < cutoff or i < len(done) - keep:
                del self._tickets[rid]
                self._expired.append(rid)
                self.state.count("results_expired")

    def _submit(self, kind: str, spec_json, blobs) -> str:
        tenant = self._who()
        self.state.loop.refuse_if_warming()  # before any frame is decoded: a cold engine takes no work
        self._expire()
        live = sum(not t.finished.is_set() for t in self._tickets.values())
        if live >= self.state.limits.max_queued_per_connection:
            raise RequestError("too_many_requests", f"{live} requests of this connection are in flight "
                                                    f"(limit {self.state.limits.max_queued_per_connection})")
        start = time.perf_counter()
        # an engine that prepares pixels on its device takes video frames still JPEG-encoded (nvJPEG there)
        processor = getattr(self.state.loop.engine, "processor", None)
        keep_jpeg = getattr(processor, "pixel_spec", None) is not None
        queue_slot = self.state.take_queue_slot(tenant)
        try:
            sub = parse_submission(kind, spec_json, blobs, self.state.limits,
                                   lambda pixels: self.state.reserve_pixels(pixels, tenant), keep_jpeg)
        except BaseException:
            queue_slot()
            raise
        release_frames = sub.release

        def release() -> None:
            release_frames()
            queue_slot()

        sub.release = release
        try:
            return self._admit(kind, sub, start, tenant)
        except BaseException:
            sub.release()
            raise

    def _adapter_of(self, tenant: Tenant, name: str | None) -> str | None:
        """The engine adapter this tenant's request names (its own first, then a shared one)."""
        if name is None:
            return None
        return self.state.with_adapters(lambda loaded: ownership.resolve(tenant, name, loaded))

    def _admit(self, kind: str, sub, start: float, tenant: Tenant) -> str:
        from serve.engine import Request, SamplingParams

        try:
            sampling = SamplingParams(**sub.sampling)
        except ValueError as e:
            raise RequestError("bad_argument", f"sampling: {e}") from None
        request_id = f"{self.conn_id}-{next(self._n)}"
        frames = sub.frames
        adapter = self._adapter_of(tenant, sub.adapter)
        request = Request(prompt=sub.prompt, images=frames if kind == "image" else [],
                          video=frames if kind == "video" else None, adapter=adapter, task=sub.task,
                          output_mode=sub.output_mode, sampling=sampling, app=sub.app, slo_ms=sub.slo_ms,
                          priority=self.state.limits.priority(sub.app), request_id=request_id, owner=self.conn_id,
                          tenant=tenant.name, tenant_weight=tenant.weight,
                          tenant_max_running=tenant.quotas.in_flight)
        refused = self.state.loop.refuses(request)  # its kind made a step fail before: it costs no one again
        if refused is not None:
            raise RequestError("rejected", refused)
        decoded = time.perf_counter()
        prepare = getattr(self.state.loop.engine, "prepare", None)
        prepared = None
        if prepare is not None:  # chat template and image preprocessing here, off the engine's thread
            try:
                prepared = prepare(request)
            except (ValueError, TypeError) as e:
                raise RequestError("rejected", str(e)) from None
        ticket = Ticket(request_id, self.conn_id, sub.tag, submitted=start,
                        frame_decode_ms=(decoded - start) * 1e3, preprocess_ms=(time.perf_counter() - decoded) * 1e3,
                        on_finish=sub.release)
        self._tickets[request_id] = ticket
        self.state.loop.submit(request, ticket, prepared)
        self.state.count(f"requests_{kind}")
        return reply(request_id=request_id)

    @guarded
    def exposed_submit_image(self, spec_json, blobs):
        """One or more images and a prompt. spec_json: see serve.rpc.wire; blobs: tuple of bytes."""
        return self._submit("image", spec_json, blobs)

    @guarded
    def exposed_submit_video(self, spec_json, blobs):
        """A video chunk (frames of e.g. 1 s at 30 fps) and a prompt."""
        return self._submit("video", spec_json, blobs)

    @guarded
    def exposed_poll(self, request_id, timeout_s=1.0):
        """The request's events since the last poll, waiting up to timeout_s for the first one."""
        if type(request_id) is not str:
            raise RequestError("bad_argument", "request_id must be a string")
        if type(timeout_s) not in (int, float) or not 0 <= timeout_s <= 3600:
            raise RequestError("bad_argument", "timeout_s must be a number of seconds in [0, 3600]")
        self._expire()
        ticket = self._tickets.get(request_id)
        if ticket is None:
            if request_id in self._expired:
                limits = self.state.limits
                raise RequestError("expired", f"request {_shown(request_id)} finished but was not polled in time: results "
                                              f"are kept {limits.result_ttl_s:g} s, at most "
                                              f"{limits.max_unpolled_per_connection or limits.max_queued_per_connection}"
                                              " per connection")
            raise RequestError("unknown_request", f"no request {_shown(request_id)} on this connection "
                                                  "(finished and collected, or never submitted)")
        events = ticket.take(min(float(timeout_s), MAX_POLL_S))
        if any(e["type"] in ("final", "error") for e in events):
            del self._tickets[request_id]
        return reply(events=events)

    @guarded
    def exposed_abort(self, request_id):
        if type(request_id) is not str or request_id not in self._tickets:
            raise RequestError("unknown_request", f"no request {_shown(request_id)} in flight on this connection")
        self.state.loop.abort(request_id)
        return reply(request_id=request_id)

    # ---- health, metrics (adapters: serve.rpc.adapter_calls) ----------------------------------
    @guarded
    def exposed_health(self):
        loop = self.state.loop
        uptime = round(time.time() - self.state.started, 3)
        if not loop.alive:  # the engine's thread or process is gone: say why, ask it nothing
            return reply(healthy=False, reason=getattr(loop, "down_reason", None) or "the engine is not running",
                         uptime_s=uptime, connections=self.state.connections)
        warming = loop.warming
        if warming is not None:  # the engine's thread is warming up: answer without asking it
            return reply(healthy=True, state="warming", warming_s=round(warming, 1), uptime_s=uptime,
                         connections=self.state.connections)
        stats = loop.call(methodcaller("stats"))
        warm = loop.warm or {}
        return reply(healthy=True, state="ready", uptime_s=uptime, warm_up_s=warm.get("seconds"),
                     connections=self.state.connections, in_flight=stats.in_flight,
                     blocks_in_use=stats.blocks_in_use, waiting=stats.waiting, running=stats.running)

    @guarded
    def exposed_metrics(self, fmt="json"):
        if not self.state.loop.alive:
            raise RequestError("engine_error", getattr(self.state.loop, "down_reason", None) or "the engine is not running")
        stats = self.state.loop.call(methodcaller("stats"))
        with self.state.lock:
            server = dict(self.state.counters, connections=self.state.connections)
            pixels_in_flight = self.state.pixels_in_flight  # a gauge: JSON only (the Prometheus text counts)
        server.update({f"engine_{k}": v for k, v in self.state.loop.counters.items()})
        server.update(GATE.metrics())  # this process's; the tenant processes' are added in below
        if self.state.door_counters is not None:  # the door's, and the tenant processes' own (added in)
            for key, value in self.state.door_counters().items():
                server[key] = server.get(key, 0) + value
        if fmt == "prometheus":
            return reply(text=prometheus_text(stats, server))
        if fmt != "json":
            raise RequestError("bad_argument", "fmt must be 'json' or 'prometheus'")
        engine = {k: v for k, v in vars(stats).items() if k != "step_times_ms"}
        return reply(engine=engine, server=server, pixels_in_flight=pixels_in_flight, gate=self._gate_by_tenant())

    def _gate_by_tenant(self) -> dict:
        """Each tenant's turns at the gate (calls, calls that queued, pacing sleeps and ms): the operator sees
        every tenant's, a tenant only its own."""
        gates = self.state.tenant_gates() if self.state.tenant_gates is not None else GATE.tenant_metrics()
        if self.tenant is None or self.tenant.operator:
            return gates
        return {self.tenant.name: gates[self.tenant.name]} if self.tenant.name in gates else {}
