"""The engine in a process of its own, seen from the RPyC front end: `EngineProcess` answers what
`EngineLoop` answers (submit, abort, call, refuses, counters, alive, engine), so the service does not
know which it has. The engine process (serve/rpc/engine_host.py) runs the step loop; the front end
keeps the connection threads, frame decoding and request preparation (its own copy of the
checkpoint's processor, serve.engine.preparer), so no amount of client traffic takes the step
loop's interpreter.

    loop = EngineProcess(functools.partial(build_engine, cfg, plan)).start()  # build runs over there
    RpcServer(loop, token, ...)

The build function crosses to a spawned interpreter: a module-level function or functools.partial
of picklable arguments. Calls (`call(fn)`) take picklable functions too (operator.methodcaller).
If the engine process dies, every request in flight is answered engine_error, `alive` turns false
(health says unhealthy) and later requests are refused with that reason.

`EngineProcess(build, attachable=True)` lets more front ends attach to the same engine process:
`EngineProcess.attach(*loop.attach_address)` in a tenant's front-end process
(serve/rpc/tenant_processes.py) answers the same calls over a link of its own; closing it closes
only that link (the engine aborts the requests it left).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections import Counter
from typing import Any

from .culprits import Culprits
from .engine_host import dumps, host, receive, receive_all, write_batches
from .gate import GATE
from .loop import Ticket
from .memory import unpinned_children
from .warming import WarmState

log = logging.getLogger("vlora.serve.rpc")


class FrontEngine:
    """The engine as the front end holds it: the checkpoint's processor and `prepare`, built here
    without weights, and the adapter calls the engine has (for `hasattr` checks; they run over
    there through EngineProcess.call)."""

    def __init__(self, info: dict):
        self.preparer = None
        if info.get("checkpoint"):
            from serve.engine.preparer import Preparer

            self.preparer = Preparer.from_checkpoint(info["checkpoint"], info.get("pixels", "host"))
        self.processor = self.preparer.processor if self.preparer is not None else None
        self._methods = frozenset(info.get("methods", ()))

    def prepare(self, request) -> tuple:
        if self.preparer is None:
            raise ValueError("this engine prepares its own requests")
        return self.preparer.prepare(request)

    def __getattr__(self, name: str):
        if name in self.__dict__.get("_methods", ()):
            def remote(*args, **kwargs):
                raise RuntimeError(f"{name} runs in the engine process: use EngineProcess.call")
            return remote
        raise AttributeError(name)


class EngineProcess(WarmState):
    on_adapters_changed = None  # called when any front end loaded or unloaded an adapter

    def __init__(self, build, idle_wait_s: float = 0.05, start_timeout_s: float | None = None,
                 attachable: bool = False):
        self._build, self.idle_wait_s, self.start_timeout_s = build, idle_wait_s, start_timeout_s
        self.attachable = attachable
        self.attach_address: tuple | None = None  # (address, key) for tenant processes, once started
        self.engine: FrontEngine | None = None
        self.culprits = Culprits()  # the engine's, learnt as it records them: refusals before preparing
        self._tickets: dict[str, Ticket] = {}
        self._calls: dict[int, tuple[dict, threading.Event]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # tickets and calls
        # commands for the engine process, pickled by their callers, written together by one thread
        # (serve/rpc/engine_host.py write_batches: a flood's requests cost its reader one read, not one each)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._local: Counter[str] = Counter()
        self._process = self._conn = self._router = None
        self._gone: str | None = None  # why the engine process is not there (after it died)

    # ---- start and stop --------------------------------------------------------------------------
    def start(self) -> "EngineProcess":
        """Spawns the engine process and returns once its engine is built (or raises: a user error
        of the build as SystemExit with its one line, another failure as RuntimeError)."""
        if self._process is not None or self._conn is not None:  # started already, or attached
            return self
        ctx = multiprocessing.get_context("spawn")  # never fork a process that has threads
        self._conn, child = ctx.Pipe(duplex=True)
        level = logging.getLogger("vlora").getEffectiveLevel()
        self._process = ctx.Process(target=host, args=(child, self._build, self.idle_wait_s, level, self.attachable),
                                    name="vlora-engine")
        with unpinned_children():  # it pins its own threshold, unless its CPU runs the forwards (serve.rpc.memory)
            self._process.start()
        child.close()
        message = self._first_message()
        if message[0] == "failed":
            self._process.join(10)
            text = message[1]
            raise SystemExit(text) if text.startswith("vlora ") else RuntimeError(f"the engine's build failed: {text}")
        self.attach_address = message[1].get("attach")
        return self._serve_link(message[1])

    @classmethod
    def attach(cls, address: str, key: bytes, timeout_s: float = 30.0) -> "EngineProcess":
        """A link of its own to a running attachable engine process (a tenant's front-end process)."""
        from multiprocessing.connection import Client

        self = cls(None, start_timeout_s=timeout_s)
        self._conn = Client(address, family="AF_UNIX", authkey=key)
        if not self._conn.poll(timeout_s):
            self._conn.close()
            raise RuntimeError(f"the engine process did not answer within {timeout_s} s")
        return self._serve_link(receive(self._conn)[1])

    def _serve_link(self, info: dict) -> "EngineProcess":
        self.engine = FrontEngine(info)
        if info.get("warming"):  # the engine process warms up now; ("warm", report) says when done
            self.warming_since = time.monotonic()
        self._writer = threading.Thread(target=write_batches, args=(self._conn, self._outbox, bytes),
                                        name="vlora-engine-writer", daemon=True)
        self._writer.start()
        self._router = threading.Thread(target=self._route, name="vlora-engine-router", daemon=True)
        self._router.start()
        return self

    def _first_message(self) -> tuple:
        deadline = None if self.start_timeout_s is None else time.monotonic() + self.start_timeout_s
        while not self._conn.poll(0.2):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine process exited while building (exit code {self._process.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                self._process.kill()
                raise RuntimeError(f"the engine was not built within {self.start_timeout_s} s")
        return receive(self._conn)

    def stop(self, timeout: float = 10.0) -> None:
        if self._conn is None:
            return
        if self._process is None:  # an attached link: closing it is all (the engine aborts what it left)
            self._gone = self._gone or "this front end stopped"
            self._outbox.put(None)
            if self._writer is not None:
                self._writer.join(5)
            self._conn.close()
            return
        try:
            self._send(("stop",))
        except OSError:
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._outbox.put(None)
        if self._writer is not None:
            self._writer.join(5)
        self._conn.close()

    @property
    def alive(self) -> bool:
        if self._process is None:  # attached: alive while its link is
            return self._router is not None and self._router.is_alive() and self._gone is None
        return self._process.is_alive() and self._gone is None

    @property
    def down_reason(self) -> str | None:
        return self._gone

    # ---- what EngineLoop answers -----------------------------------------------------------------
    def refuses(self, request) -> str | None:
        if self._gone is not None:
            return self._gone
        return self.culprits.refuses(request)

    def submit(self, request, ticket: Ticket, prepared=None) -> None:
        meta = (ticket.request_id, ticket.tag, ticket.submitted, ticket.frame_decode_ms, ticket.preprocess_ms)
        with self._lock:
            self._tickets[ticket.request_id] = ticket
        try:
            self._send(("add", request, prepared, meta))
        except OSError:
            self._finish(ticket.request_id, {"type": "error", "error": {
                "type": "engine_error", "message": self._gone or "the engine process is not running"}})

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except OSError:
            pass

    def call(self, fn, timeout: float = 30.0):
        """fn(engine) in the engine process (fn picklable); its value, or its exception raised here."""
        self.refuse_if_warming()
        return self._ask(timeout, "call", fn)

    @property
    def counters(self) -> Counter:
        """The engine loop's counters (asked of the engine process) and the front end's own."""
        try:
            remote = self._ask(5.0, "counters")
        except (RuntimeError, TimeoutError, OSError):
            remote = {}
        return Counter(remote) + self._local

    # ---- the pipe --------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        """Queues a command for the writer thread. A command lost with a broken pipe is answered by
        `_died` (the router reads the pipe's end), as everything registered before sending is."""
        if self._gone is not None or self._writer is None or not self._writer.is_alive():
            raise OSError(self._gone or "the engine process is not running")
        self._outbox.put(dumps(message))  # pickled here: a big request holds up no other sender

    def _ask(self, timeout: float, kind: str, *args):
        """Sends (kind, call_id, *args) and waits for the engine process's reply to that call_id."""
        call_id = next(self._ids)
        box: dict[str, Any] = {}
        done = threading.Event()
        with self._lock:
            self._calls[call_id] = (box, done)
        try:
            self._send((kind, call_id, *args))
        except OSError:
            self._calls.pop(call_id, None)
            raise RuntimeError(self._gone or "the engine process is not running") from None
        with GATE.released():  # waiting for the engine holds no turn of the connection threads
            answered = done.wait(timeout)
        with self._lock:
            self._calls.pop(call_id, None)
        if not answered:
            raise TimeoutError(f"the engine did not answer within {timeout} s")
        if not box["ok"]:
            raise box["value"]
        return box["value"]

    def _route(self) -> None:
        """Files the engine process's messages: events on their tickets, answers to their callers."""
        while True:
            try:
                messages = receive_all(self._conn)
            except (EOFError, OSError):
                break
            for message in messages:
                self._file(message)
        self._died()

    def _file(self, message: tuple) -> None:
        """One message of the engine process: an event on its ticket, an answer to its caller."""
        kind = message[0]
        if kind == "event":
            _, request_id, event = message
            if event["type"] in ("final", "error"):
                self._finish(request_id, event, time.perf_counter())
            else:
                ticket = self._tickets.get(request_id)
                if ticket is not None:
                    ticket.put(event)
        elif kind == "reply":
            _, call_id, ok, value = message
            with self._lock:
                waiting = self._calls.get(call_id)
            if waiting is not None:
                box, done = waiting
                box.update(ok=ok, value=value)
                done.set()
        elif kind == "culprit":
            self.culprits.learn(message[1], message[2])
        elif kind == "warm":
            self.warmed(message[1])
        elif kind == "adapters":
            hook = self.on_adapters_changed
            if hook is not None:
                hook()

    def _finish(self, request_id: str, event: dict, arrived: float | None = None) -> None:
        with self._lock:
            ticket = self._tickets.pop(request_id, None)
        if ticket is not None:
            timing = event.get("timing")
            if arrived is not None and timing and timing.get("total_ms") is not None:
                # the final's way from the engine's step loop to here (one clock for both processes)
                timing["pipe_ms"] = round((arrived - ticket.submitted) * 1e3 - timing["total_ms"], 3)
            ticket.put(event)

    def _died(self) -> None:
        """The pipe closed: a stop, or the engine process died. Every waiter is answered."""
        if self._process is None:  # an attached link: its own stop, or the engine process is gone
            code = None
            self._gone = self._gone or "the engine process is gone; the server must be restarted"
        else:
            self._process.join(1)
            code = self._process.exitcode
            self._gone = f"the engine process exited (exit code {code}); the server must be restarted"
        if code not in (0, None):
            self._local["engine_process_exits"] += 1
            log.error("%s", self._gone)
        with self._lock:
            tickets, self._tickets = list(self._tickets.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for ticket in tickets:
            ticket.put({"type": "error", "error": {"type": "engine_error", "message": self._gone}})
        for box, done in calls:
            box.update(ok=False, value=RuntimeError(self._gone))
            done.set()
