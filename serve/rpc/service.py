"""The RPyC service: the server's only surface. One instance per connection.

Every exposed method takes plain values and returns one JSON string, `{"ok": true, ...}` or
`{"ok": false, "error": {"type": ..., "message": ...}}`: no object of the server is ever handed
out by reference and no exception object crosses the wire, so a client can neither walk into
the server's attributes nor make it run client code. Nothing a client sends can stop the engine
thread; a client's own requests are aborted when it disconnects.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rpyc

from .loop import EngineLoop, Ticket
from .replies import guarded, reply
from .metrics import prometheus_text
from .wire import Limits, RequestError, check_adapter_name, parse_submission

log = logging.getLogger("vlora.serve.rpc")
MAX_POLL_S = 5.0


@dataclass
class ServerState:
    """What all connections share."""

    loop: EngineLoop
    limits: Limits
    max_connections: int = 64
    started: float = field(default_factory=time.time)
    connections: int = 0
    counters: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ids: Any = field(default_factory=itertools.count)

    pixels_in_flight: int = 0  # decoded frame pixels of the requests the server holds, all connections

    def admit(self) -> bool:
        with self.lock:
            return self.connections < self.max_connections

    def reserve_pixels(self, pixels: int):
        """Takes `pixels` from the server-wide budget of decoded frames; returns the release (idempotent).
        Over the budget the request is refused as busy (retryable), never queued in memory."""
        with self.lock:
            if self.pixels_in_flight and self.pixels_in_flight + pixels > self.limits.max_pixels_in_flight:
                self.counters["errors_busy_pixels"] += 1
                raise RequestError("busy", f"the server holds {self.pixels_in_flight} decoded pixels of requests in "
                                           "flight, its limit; retry shortly")
            self.pixels_in_flight += pixels
        released = []

        def release() -> None:
            with self.lock:
                if not released:
                    released.append(True)
                    self.pixels_in_flight -= pixels

        return release

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counters[key] += n


class VLoRAService(rpyc.Service):
    def __init__(self, state: ServerState):
        self.state = state
        self.conn_id = f"c{next(state.ids)}"
        self._tickets: dict[str, Ticket] = {}
        self._expired: deque[str] = deque(maxlen=1024)  # results forgotten unpolled, to say so when asked
        self._n = itertools.count()
        self._connected = False

    def on_connect(self, conn) -> None:
        with self.state.lock:
            self.state.connections += 1
            self.state.counters["connections_total"] += 1
        self._connected = True

    def on_disconnect(self, conn) -> None:
        if not self._connected:
            return
        self._connected = False
        for request_id, ticket in list(self._tickets.items()):
            if not ticket.finished.is_set():
                self.state.loop.abort(request_id)  # its KV blocks and slot go back to the engine
                self.state.count("aborted_on_disconnect")
        self._tickets.clear()
        with self.state.lock:
            self.state.connections -= 1

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
        self._expire()
        live = sum(not t.finished.is_set() for t in self._tickets.values())
        if live >= self.state.limits.max_queued_per_connection:
            raise RequestError("too_many_requests", f"{live} requests of this connection are in flight "
                                                    f"(limit {self.state.limits.max_queued_per_connection})")
        start = time.perf_counter()
        # an engine that prepares pixels on its device takes video frames still JPEG-encoded (nvJPEG there)
        processor = getattr(self.state.loop.engine, "processor", None)
        keep_jpeg = getattr(processor, "pixel_spec", None) is not None
        sub = parse_submission(kind, spec_json, blobs, self.state.limits, self.state.reserve_pixels, keep_jpeg)
        try:
            return self._admit(kind, sub, start)
        except BaseException:
            sub.release()
            raise

    def _admit(self, kind: str, sub, start: float) -> str:
        from serve.engine import Request, SamplingParams

        try:
            sampling = SamplingParams(**sub.sampling)
        except ValueError as e:
            raise RequestError("bad_argument", f"sampling: {e}") from None
        request_id = f"{self.conn_id}-{next(self._n)}"
        frames = sub.frames
        request = Request(prompt=sub.prompt, images=frames if kind == "image" else [],
                          video=frames if kind == "video" else None, adapter=sub.adapter, task=sub.task,
                          output_mode=sub.output_mode, sampling=sampling, app=sub.app, slo_ms=sub.slo_ms,
                          priority=self.state.limits.priority(sub.app), request_id=request_id, owner=self.conn_id)
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
                raise RequestError("expired", f"request {request_id!r} finished but was not polled in time: results "
                                              f"are kept {limits.result_ttl_s:g} s, at most "
                                              f"{limits.max_unpolled_per_connection or limits.max_queued_per_connection}"
                                              " per connection")
            raise RequestError("unknown_request", f"no request {request_id!r} on this connection "
                                                  "(finished and collected, or never submitted)")
        events = ticket.take(min(float(timeout_s), MAX_POLL_S))
        if any(e["type"] in ("final", "error") for e in events):
            del self._tickets[request_id]
        return reply(events=events)

    @guarded
    def exposed_abort(self, request_id):
        if type(request_id) is not str or request_id not in self._tickets:
            raise RequestError("unknown_request", f"no request {request_id!r} in flight on this connection")
        self.state.loop.abort(request_id)
        return reply(request_id=request_id)

    # ---- adapters, health, metrics -------------------------------------------------------------
    @guarded
    def exposed_list_adapters(self):
        adapters = self.state.loop.call(lambda e: e.list_adapters() if hasattr(e, "list_adapters") else [])
        return reply(adapters=adapters)

    @guarded
    def exposed_load_adapter(self, name, path):
        """Loads the adapter directory `path` (relative to the server's adapter root) as `name`."""
        if type(path) is not str:
            raise RequestError("bad_argument", "load_adapter takes a name and a directory path under the server's "
                                               "adapter root (strings)")
        check_adapter_name(name)
        if not hasattr(self.state.loop.engine, "load_adapter"):
            raise RequestError("unsupported", "this engine serves the base model only; it cannot load adapters")
        directory = self._under_root(path)
        try:
            self.state.loop.call(lambda e: e.load_adapter(name, str(directory)))
        except (OSError, ValueError) as e:  # name what the caller gave, never the server's own paths
            raise RequestError("rejected", str(e).replace(str(directory), path)) from None
        return reply(adapter=name)

    def _under_root(self, path: str) -> Path:
        """The directory `path` names under rpc.adapter_root; a path that would leave the root (.., an
        absolute path elsewhere, a symbolic link out) is refused the same way whether it exists or not."""
        root = self.state.limits.adapter_root
        if not root:
            raise RequestError("forbidden", "this server loads no adapters at run time; its operator can allow it "
                                            "from one directory with rpc.adapter_root=<dir>")
        if "\0" in path or len(path) > 4096:
            raise RequestError("bad_argument", "the adapter path must be a plain path of at most 4096 characters")
        base = Path(root).resolve()
        directory = (base / path).resolve()
        if directory != base and base not in directory.parents:
            raise RequestError("forbidden", "the adapter path must lie under the server's adapter root")
        return directory

    @guarded
    def exposed_unload_adapter(self, name):
        check_adapter_name(name)
        if not hasattr(self.state.loop.engine, "unload_adapter"):
            raise RequestError("unsupported", "this engine serves the base model only; it has no adapters to unload")
        try:
            self.state.loop.call(lambda e: e.unload_adapter(name))
        except ValueError as e:  # not loaded, or in use: the caller's mistake, not the server's
            raise RequestError("rejected", str(e)) from None
        return reply(adapter=name)

    @guarded
    def exposed_health(self):
        stats = self.state.loop.call(lambda e: e.stats())
        return reply(healthy=self.state.loop.alive, uptime_s=round(time.time() - self.state.started, 3),
                      connections=self.state.connections, in_flight=stats.in_flight,
                      blocks_in_use=stats.blocks_in_use, waiting=stats.waiting, running=stats.running)

    @guarded
    def exposed_metrics(self, fmt="json"):
        stats = self.state.loop.call(lambda e: e.stats())
        with self.state.lock:
            server = dict(self.state.counters, connections=self.state.connections)
            pixels_in_flight = self.state.pixels_in_flight  # a gauge: JSON only (the Prometheus text counts)
        server.update({f"engine_{k}": v for k, v in self.state.loop.counters.items()})
        if fmt == "prometheus":
            return reply(text=prometheus_text(stats, server))
        if fmt != "json":
            raise RequestError("bad_argument", f"fmt must be 'json' or 'prometheus', got {fmt!r}")
        engine = {k: v for k, v in vars(stats).items() if k != "step_times_ms"}
        return reply(engine=engine, server=server, pixels_in_flight=pixels_in_flight)
