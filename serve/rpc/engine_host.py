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
then ("event", request_id, event), ("reply", call_id, ok, value), ("culprit", fingerprint, why),
("adapters",) (an adapter was loaded or unloaded: names kept by a front end are stale).

With `attachable`, more front ends (tenant processes) attach later (serve/rpc/engine_links.py): the
first pipe's ("stop",) or end stops the engine, another link's only closes that link.
"""

from __future__ import annotations

import io
import logging
import pickle
import queue
import threading

from .engine_links import Link, Links, changes_adapters
from .loop import EngineLoop
from .memory import pin_unless_forwarding, trim_when_idle

log = logging.getLogger("vlora.serve.rpc")
ADAPTER_CALLS = ("list_adapters", "load_adapter", "unload_adapter", "adapter_names")


class _RemoteTicket:
    """The loop's view of a front-end Ticket: events go to its link's sender."""

    def __init__(self, link: Link, request_id: str, tag, submitted: float, frame_decode_ms: float,
                 preprocess_ms: float):
        self.link, self.outbox, self.request_id, self.tag = link, link.outbox, request_id, tag
        # time.perf_counter() is CLOCK_MONOTONIC on Linux: one clock for both processes
        self.submitted, self.frame_decode_ms, self.preprocess_ms = submitted, frame_decode_ms, preprocess_ms

    def put(self, event: dict) -> None:
        if event["type"] in ("final", "error"):
            self.link.finished(self.request_id)
        self.outbox.put(("event", self.request_id, event))


class _Reply:
    """Stands in for the threading.Event of EngineLoop.call: set() on the engine thread sends the answer
    (and, after a load or unload, tells every front end that the adapters changed)."""

    def __init__(self, outbox, call_id: int, box: dict, after=None):
        self.outbox, self.call_id, self.box, self.after = outbox, call_id, box, after

    def set(self) -> None:
        box = self.box
        self.outbox.put(("reply", self.call_id, "error" not in box, box.get("error", box.get("value"))))
        if self.after is not None:
            self.after()


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
    """The engine process's sender: the loop's events and answers to one front end."""
    write_batches(conn, outbox, first_alone=True)
    try:
        conn.close()
    except OSError:
        pass


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


def host(conn, build, idle_wait_s: float, log_level: int, attachable: bool = False) -> None:
    """The process's entry: build() gives the engine; serves commands until ("stop",) or the pipe closes.
    attachable: tenant front-end processes may attach (info["attach"]: the address and key)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = build()
    except BaseException as e:  # noqa: BLE001 - a user error (SystemExit) or a failed build: the front end says it
        conn.send_bytes(dumps(("failed", str(e) if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}")))
        return
    pin_unless_forwarding(engine)  # requests of megabytes arrive here too, and a CPU engine's forwards (serve.rpc.memory)
    primary = Link("the server")
    outbox = primary.outbox
    sender = threading.Thread(target=_send_all, args=(conn, outbox), name="vlora-engine-sender", daemon=True)
    sender.start()
    links = Links(primary)
    loop = EngineLoop(engine, idle_wait_s)
    loop.culprits.on_record = lambda key, why: links.broadcast(("culprit", key, why))
    loop.on_warm = lambda report: links.broadcast(("warm", report))
    info = dict(info_of(engine), warming=bool(getattr(engine, "needs_warm_up", False)))
    if attachable:
        address, key = links.listen()
        info["attach"] = (address, key)
    outbox.put(("ready", info))  # before the loop starts: its ("warm", ...) can only come after
    loop.start()
    if attachable:
        threading.Thread(target=links.accept_forever, args=(lambda c, link: _serve_link(c, loop, link, links),
                                                            info),
                         name="vlora-engine-attach", daemon=True).start()
    trimmer = trim_when_idle(lambda: not engine.has_unfinished())
    try:
        _serve(conn, loop, primary, links)
    finally:
        links.close()
        if trimmer is not None:
            trimmer.set()
        loop.stop()
        outbox.put(None)
        sender.join(5)
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def _serve(conn, loop: EngineLoop, link: Link, links: Links) -> None:
    while True:
        try:
            messages = receive_all(conn)
        except (EOFError, OSError):  # the front end exited: so does the engine (the first pipe's)
            return
        for message in messages:
            if not _command(message, loop, link, links):
                return


def _serve_link(conn, loop: EngineLoop, link: Link, links: Links) -> None:
    """An attached front end, until it stops or goes: then its requests are aborted and the link closed."""
    sender = threading.Thread(target=_send_all, args=(conn, link.outbox), name=f"vlora-engine-{link.name}-sender",
                              daemon=True)
    sender.start()
    try:
        _serve(conn, loop, link, links)
    finally:
        links.remove(link)
        aborted = link.take_live()
        for request_id in aborted:  # their blocks and slots go back; nobody is left to read them
            loop.abort(request_id)
        if aborted:
            log.warning("engine process: %s went away; %d request(s) of it aborted", link.name, len(aborted))
        link.outbox.put(None)


def _command(message: tuple, loop: EngineLoop, link: Link, links: Links) -> bool:
    """Carries out one command of a front end; False for ("stop",)."""
    kind = message[0]
    outbox = link.outbox
    if kind == "add":
        _, request, prepared, meta = message
        link.added(meta[0])
        loop.submit(request, _RemoteTicket(link, *meta), prepared)
    elif kind == "abort":
        loop.abort(message[1])
    elif kind == "call":
        _, call_id, fn = message
        box: dict = {}
        after = (lambda: links.broadcast(("adapters",))) if changes_adapters(fn) else None
        loop.post_call(fn, box, _Reply(outbox, call_id, box, after))
    elif kind == "counters":
        outbox.put(("reply", message[1], True, dict(loop.counters)))
    elif kind == "stop":
        return False
    return True
