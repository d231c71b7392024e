"""The engine's process: builds the engine, runs its step loop (serve/rpc/loop.py) and talks to the
RPyC front end (serve/rpc/engine_process.py) over one pipe.

Why a process of its own: CPython runs one thread's bytecode at a time, so in one process every
client connection's thread takes turns at the interpreter with the step loop, and 32 clients
calling `poll` in a loop slowed a victim's request 16-21 fold on a GPU with no engine work queued.
Here the step loop shares the interpreter with two threads only: this one reading commands, and a
sender that writes the loop's events back (the loop never writes to the pipe itself, so a front end
slow to read cannot stall a step).

Messages, front end -> engine: ("add", request, prepared, meta), ("abort", request_id),
("call", call_id, fn) (fn(engine), picklable: a module-level function or operator.methodcaller),
("counters", call_id), ("stop",). Engine -> front end: ("ready", info) or ("failed", message) once,
then ("warm", report) once the engine's warm-up is over (info["warming"] says whether one runs),
then ("event", request_id, event), ("reply", call_id, ok, value), ("culprit", fingerprint, why).
"""

from __future__ import annotations

import io
import logging
import pickle
import queue
import threading

from .loop import EngineLoop
from .memory import pin_mmap_threshold, trim_when_idle

log = logging.getLogger("vlora.serve.rpc")
ADAPTER_CALLS = ("list_adapters", "load_adapter", "unload_adapter", "adapter_names")


class _RemoteTicket:
    """The loop's view of a front-end Ticket: events go to the sender's queue."""

    def __init__(self, outbox, request_id: str, tag, submitted: float, frame_decode_ms: float, preprocess_ms: float):
        self.outbox, self.request_id, self.tag = outbox, request_id, tag
        # time.perf_counter() is CLOCK_MONOTONIC on Linux: one clock for both processes
        self.submitted, self.frame_decode_ms, self.preprocess_ms = submitted, frame_decode_ms, preprocess_ms

    def put(self, event: dict) -> None:
        self.outbox.put(("event", self.request_id, event))


class _Reply:
    """Stands in for the threading.Event of EngineLoop.call: set() on the engine thread sends the answer."""

    def __init__(self, outbox, call_id: int, box: dict):
        self.outbox, self.call_id, self.box = outbox, call_id, box

    def set(self) -> None:
        box = self.box
        self.outbox.put(("reply", self.call_id, "error" not in box, box.get("error", box.get("value"))))


# Messages waiting in an outbox go out together, in one write of their pickles back to back (read by
# `receive_all`), in both directions: a step of 256 requests' tokens was 256 writes here and 256 reads
# in the front end, whose router thread gave up the interpreter at each read and waited for it behind
# the connection threads (one busy thread: about 1,100 events a second, `bench.engine_pipe`), so a
# victim's answer queued behind a flood's tokens; a flood's 256 requests were as many reads by the
# engine process's reader, each waiting for the interpreter behind the step loop. The engine's first
# message ("ready") goes alone: the front end reads it before its router starts.
BATCH_MESSAGES = 512
BATCH_BYTES = 4 << 20


def _pickled(message) -> bytes | None:
    try:
        return dumps(message)
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # an answer that cannot cross
        if message[0] != "reply":
            log.error("engine process: a %s message could not be sent (%s)", message[0], e)
            return None
        value = message[3]
        text = f"{type(value).__name__}: {value}" if isinstance(value, BaseException) else f"unsendable {e}"
        return dumps(("reply", message[1], False, RuntimeError(text)))


def write_batches(conn, outbox, encode=_pickled, first_alone: bool = False) -> None:
    """Writes what `outbox` holds until a None: each write takes every item waiting then (up to
    BATCH_MESSAGES or BATCH_BYTES), encode(item) -> bytes (None: skipped). Returns when the pipe breaks."""
    first = first_alone
    while True:
        item = outbox.get()
        if item is None:
            return
        parts, size, done = [], 0, False
        while True:
            data = encode(item)
            if data is not None:
                parts.append(data)
                size += len(data)
            if first or len(parts) >= BATCH_MESSAGES or size >= BATCH_BYTES:
                break
            try:
                item = outbox.get_nowait()
            except queue.Empty:
                break
            if item is None:
                done = True
                break
        first = False
        try:
            if parts:
                conn.send_bytes(b"".join(parts))
        except OSError:  # the other side is gone
            return
        if done:
            return


def _send_all(conn, outbox) -> None:
    """The engine process's sender: the loop's events and answers to the front end."""
    write_batches(conn, outbox, first_alone=True)


def dumps(message) -> bytes:
    """Plain pickle, not multiprocessing's: that one moves every tensor through a shared-memory file
    and a file-descriptor hand-off served by a thread of the sender, a round trip per tensor that
    costs more than copying a request's few small tensors."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def receive(conn):
    return pickle.loads(conn.recv_bytes())


def receive_all(conn) -> list:
    """The messages of one write of `write_batches`: one or more pickles back to back."""
    stream = io.BytesIO(conn.recv_bytes())
    end, out = len(stream.getbuffer()), []
    while stream.tell() < end:
        out.append(pickle.load(stream))
    return out


def info_of(engine) -> dict:
    """What the front end needs to prepare requests and answer capability checks by itself."""
    checkpoint = getattr(engine, "checkpoint", None)
    return {"checkpoint": str(checkpoint) if checkpoint is not None and hasattr(engine, "preparer") else None,
            "pixels": getattr(engine, "pixels", "host"),
            "methods": [m for m in ADAPTER_CALLS if hasattr(engine, m)]}


def host(conn, build, idle_wait_s: float, log_level: int) -> None:
    """The process's entry: build() gives the engine; serves commands until ("stop",) or the pipe closes."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pin_mmap_threshold()  # requests of megabytes arrive here too (serve.rpc.memory)
    try:
        engine = build()
    except BaseException as e:  # noqa: BLE001 - a user error (SystemExit) or a failed build: the front end says it
        conn.send_bytes(dumps(("failed", str(e) if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}")))
        return
    outbox: "queue.SimpleQueue" = queue.SimpleQueue()
    sender = threading.Thread(target=_send_all, args=(conn, outbox), name="vlora-engine-sender", daemon=True)
    sender.start()
    loop = EngineLoop(engine, idle_wait_s)
    loop.culprits.on_record = lambda key, why: outbox.put(("culprit", key, why))
    loop.on_warm = lambda report: outbox.put(("warm", report))
    info = dict(info_of(engine), warming=bool(getattr(engine, "needs_warm_up", False)))
    outbox.put(("ready", info))  # before the loop starts: its ("warm", ...) can only come after
    loop.start()
    trimmer = trim_when_idle(lambda: not engine.has_unfinished())
    try:
        _serve(conn, loop, outbox)
    finally:
        if trimmer is not None:
            trimmer.set()
        loop.stop()
        outbox.put(None)
        sender.join(5)
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def _serve(conn, loop: EngineLoop, outbox) -> None:
    while True:
        try:
            messages = receive_all(conn)
        except (EOFError, OSError):  # the front end exited: so does the engine
            return
        for message in messages:
            if not _command(message, loop, outbox):
                return


def _command(message: tuple, loop: EngineLoop, outbox) -> bool:
    """Carries out one command of the front end; False for ("stop",)."""
    kind = message[0]
    if kind == "add":
        _, request, prepared, meta = message
        loop.submit(request, _RemoteTicket(outbox, *meta), prepared)
    elif kind == "abort":
        loop.abort(message[1])
    elif kind == "call":
        _, call_id, fn = message
        box: dict = {}
        loop.post_call(fn, box, _Reply(outbox, call_id, box))
    elif kind == "counters":
        outbox.put(("reply", message[1], True, dict(loop.counters)))
    elif kind == "stop":
        return False
    return True
