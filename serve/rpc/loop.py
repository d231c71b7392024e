"""The engine's own thread: the only code that touches the engine while the server runs.

Connection threads (one per client) validate and decode frames, then hand a `Request` to the
loop through a queue; the loop adds it, steps the engine while anything is unfinished and files
each output as an event on its request's `Ticket`, where the connection thread picks it up.
An exception in one request's admission is that request's error. An exception inside a step is
charged to the request that causes it (serve/rpc/step_failures.py): that request is answered `engine_error`, the
others start over once, and requests of the culprit's kind are refused from then on (`refuses`, which
connection threads may call before submitting), so no kind of request costs the others more than one
restart.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from serve.engine.request import phases_ms

from .culprits import Culprits
from .gate import GATE
from .step_failures import StepFailures
from .warming import WarmState

log = logging.getLogger("vlora.serve.rpc")


@dataclass
class Ticket:
    """One request's mailbox: events flow engine thread -> connection thread."""

    request_id: str
    owner: str  # connection id
    tag: str | None = None
    submitted: float = field(default_factory=time.perf_counter)
    frame_decode_ms: float = 0.0
    preprocess_ms: float = 0.0  # chat template + image preprocessing, on the connection's thread
    events: "queue.Queue[dict[str, Any]]" = field(default_factory=queue.Queue)
    finished: threading.Event = field(default_factory=threading.Event)
    finished_at: float | None = None  # time.monotonic() of the final (or error) event
    on_finish: Any = None  # called once the request is over (gives its frames' memory budget back)

    def put(self, event: dict[str, Any]) -> None:
        event = {"request_id": self.request_id, "tag": self.tag, **event}
        # queued before `finished` is set: whoever wakes on it finds the final event already there
        self.events.put(event)
        if event["type"] in ("final", "error"):
            self.finished_at = time.monotonic()
            self.finished.set()
            if self.on_finish is not None:
                self.on_finish()

    def take(self, timeout: float) -> list[dict[str, Any]]:
        """Every event waiting now, after waiting up to `timeout` seconds for the first."""
        try:
            with GATE.released():  # waiting for the engine holds no turn of the connection threads
                out = [self.events.get(timeout=max(timeout, 0.0))]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1e3, 3)


class EngineLoop(StepFailures, WarmState):
    def __init__(self, engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._commands: "queue.Queue[tuple]" = queue.Queue()
        self._tickets: dict[str, Ticket] = {}  # engine thread only
        self._requests: dict[str, Any] = {}  # the Request of each ticket (engine thread only)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counters: Counter[str] = Counter()  # read by other threads; ints, updated atomically enough
        self.culprits = Culprits()  # kinds of request that made a step fail (written here, read by any thread)
        self._restarts: Counter[str] = Counter()  # request id -> unattributed failures it was restarted for
        self._failure_sites: set[tuple] = set()  # (exception type, file, line) already logged with a traceback
        # held around engine calls so stats() from other threads is consistent; re-entrant, since the
        # engine takes in arrivals (_take_arrivals) inside the step that holds it
        self.lock = threading.RLock()
        self._held: tuple | None = None  # a command met mid-step that must wait for the step's end
        self.warm_shape: dict = {}  # Engine.warm_up's picture shape (side, frames); default: the engine config's
        # the engine's warm-up (serve/engine/warmup.py) runs first on the loop's thread (WarmState)
        self.warming_since: float | None = None

    # ---- any thread ----------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        if getattr(self.engine, "needs_warm_up", False):  # set before the thread: no submit slips in ahead
            self.warming_since = time.monotonic()
        if hasattr(self.engine, "during_step"):
            self.engine.during_step = self._take_arrivals
        self._thread = threading.Thread(target=self._run, name="vlora-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
        if getattr(self.engine, "during_step", None) == self._take_arrivals:  # a later loop or caller steps it
            self.engine.during_step = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def refuses(self, request) -> str | None:
        """Why `request` would be refused (its kind made a step fail), or None; any thread. The
        server calls it before preparing a request, so such a request costs no one anything."""
        return self.culprits.refuses(request)

    def submit(self, request, ticket: Ticket, prepared=None) -> None:
        """`prepared`: engine.prepare(request), done by the caller's thread (optional)."""
        request.received = time.perf_counter()  # not when a step in flight lets the loop take it in
        self._commands.put(("add", request, ticket, prepared))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def call(self, fn, timeout: float = 30.0):
        """Run fn(engine) on the engine thread (adapter loading, stats) and return its result."""
        self.refuse_if_warming()  # the thread is busy warming up: answer now rather than time out
        box: dict[str, Any] = {}
        done = threading.Event()
        self.post_call(fn, box, done)
        with GATE.released():
            answered = done.wait(timeout)
        if not answered:
            raise TimeoutError(f"the engine did not answer within {timeout} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def post_call(self, fn, box: dict, done) -> None:
        """Runs fn(engine) on the engine thread, then box["value"] (or box["error"]) and done.set();
        returns at once."""
        self._commands.put(("call", fn, box, done))

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        if self.warming_since is not None:
            self._warm_up()
        linger = getattr(self.engine, "linger_s", None)
        while not self._stop.is_set():
            busy = self.engine.has_unfinished()
            self._drain(block=not busy)
            if not self.engine.has_unfinished():
                continue
            wait = linger() if linger is not None else 0.0
            if wait > 0:  # a tenant about to come back: its next request need not wait for a whole step of others'
                start = time.perf_counter()
                # ends at the first arrival (then asked again); the wait is over before that arrival is taken in
                self._drain(block=True, timeout=wait, waited=lambda: self.engine.lingered(time.perf_counter() - start))
                continue
            self._step()

    def _warm_up(self) -> None:
        try:
            with self.lock:
                report = self.engine.warm_up(**self.warm_shape)  # logs its own line
            self.warmed(report.to_dict())
        except Exception as e:  # a warm-up is a speed-up: serving goes on cold, and the log says why
            log.error("engine warm-up failed (%s: %s); serving without it", type(e).__name__, e)
            self.warmed({"error": f"{type(e).__name__}: {e}"})

    def _take_arrivals(self) -> None:
        """Mid-step (engine thread, while the device runs the step): requests that arrived are added,
        so the engine can encode their pictures ahead. Only additions, in order, up to the first other
        command (an abort or a call must not change the batch under the step; a call may load the
        adapter a later addition needs), which waits for the step's end."""
        while self._held is None:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._handle(command)
            else:
                self._held = command

    def _drain(self, block: bool, timeout: float | None = None, waited=None) -> None:
        """Handles every command waiting, after waiting up to `timeout` (or idle_wait_s) for the first if
        `block`; `waited()` is called once that wait is over, before any command is handled."""
        if self._held is not None:
            command, self._held = self._held, None
        else:
            try:
                command = self._commands.get(timeout=timeout or self.idle_wait_s) if block else \
                    self._commands.get_nowait()
            except queue.Empty:
                if waited is not None:
                    waited()
                return
        if waited is not None:
            waited()
        while True:
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request, ticket, prepared = command
            why = self.culprits.refuses(request)  # its kind failed a step since it was submitted
            if why is not None:
                self.counters["refused_failing_kind"] += 1
                ticket.put({"type": "error", "error": {"type": "rejected", "message": why}})
                return
            try:
                with self.lock:
                    if prepared is None:
                        self.engine.add_request(request)
                    else:
                        self.engine.add_request(request, prepared)
            except Exception as e:  # bad for this request only (unknown adapter, too long, ...)
                self.counters["rejected"] += 1
                ticket.put({"type": "error", "error": {"type": "rejected", "message": str(e)}})
                return
            self._tickets[ticket.request_id] = ticket
            self._requests[ticket.request_id] = request  # to start it over if a step fails (see _isolate)
            self.counters["admitted"] += 1
        elif kind == "abort":
            ticket = self._tickets.pop(command[1], None)
            self._requests.pop(command[1], None)
            self._restarts.pop(command[1], None)
            if ticket is not None:
                with self.lock:
                    self.engine.abort(command[1])
                self.counters["aborted"] += 1
                ticket.put({"type": "final", "text": "", "token_ids": [], "finish_reason": "abort", "timing": {}})
        elif kind == "call":
            _, fn, box, done = command
            try:
                with self.lock:
                    box["value"] = fn(self.engine)
            except Exception as e:
                box["error"] = e
            done.set()

    def _step(self) -> None:
        try:
            with self.lock:
                outputs = self.engine.step()
        except Exception as e:
            self.counters["step_errors"] += 1
            try:
                charged, restarted = self._isolate()
            except Exception as inner:  # the engine cannot even run requests alone: everyone is told
                self._log_failure(e, f"and the engine fails alone too ({type(inner).__name__}); every request "
                                     "in flight is answered engine_error")
                self._fail_all(f"the engine failed while running this request ({type(e).__name__})")
                return
            self._log_failure(e, f"charged to {charged} request(s); {restarted} restarted")
            return
        for out in outputs:
            ticket = self._tickets.get(out.request_id)
            if ticket is None:  # aborted: its final event is already out
                continue
            if out.finished:
                del self._tickets[out.request_id]
                self._requests.pop(out.request_id, None)
                self._restarts.pop(out.request_id, None)
                self.counters["finished"] += 1
                ticket.put(self._final(ticket, out))
            elif out.new_token_ids:
                ticket.put({"type": "tokens", "text": out.new_text, "token_ids": list(out.new_token_ids)})

    def _final(self, ticket: Ticket, out) -> dict[str, Any]:
        m = out.metrics
        timing = {"frame_decode_ms": round(ticket.frame_decode_ms, 3), "preprocess_ms": round(ticket.preprocess_ms, 3),
                  "queue_ms": _ms(m.arrival_time, m.first_scheduled_time),
                  "prefill_ms": _ms(m.first_scheduled_time, m.first_token_time),
                  "decode_ms": _ms(m.first_token_time, m.finished_time),
                  "total_ms": _ms(ticket.submitted, time.perf_counter()),
                  "prompt_tokens": m.num_prompt_tokens, "cached_tokens": m.num_cached_tokens,
                  "preemptions": m.num_preemptions,
                  # its steps (how many, their wall ms, every request's tokens in them, arrivals taken in
                  # during them, planning after its first): the rest of queue-to-final is the loop's between steps
                  "steps": m.steps, "step_ms": round(m.step_s * 1e3, 3), "step_tokens": m.step_tokens,
                  "intake_ms": round(m.intake_s * 1e3, 3), "plan_ms": round(m.plan_s * 1e3, 3),
                  "graph_steps": m.graph_steps, "first_step_ms": round(m.first_step_s * 1e3, 3),
                  "first_step_tokens": m.first_step_tokens, "first_phases_ms": phases_ms(m.first_phases_s),
                  "last_phases_ms": phases_ms(m.last_phases_s), "first_step_cpu_ms": round(m.first_step_cpu_s * 1e3, 3),
                  "last_step_ms": round(m.last_step_s * 1e3, 3), "last_step_cpu_ms": round(m.last_step_cpu_s * 1e3, 3),
                  "steps_before": m.steps_before,
                  "lingered_before_ms": round(m.lingered_before_s * 1e3, 3),
                  "gc_before_ms": round(m.gc_before_s * 1e3, 3), "gc_ms": round(m.gc_s * 1e3, 3),
                  "passed_over": m.passed_over, "passed_reason": m.passed_reason}
        event = {"type": "final", "text": out.text, "token_ids": list(out.token_ids),
                 "finish_reason": out.finish_reason, "timing": timing}
        head = getattr(out, "head", None)
        if head is not None:
            event["head"] = head.to_dict() if hasattr(head, "to_dict") else head
        if out.new_token_ids:
            event["new_text"] = out.new_text
        return event
