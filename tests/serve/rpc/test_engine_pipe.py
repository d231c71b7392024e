"""The engine process's pipe to the front end: waiting messages go out in one write, read back in order."""

from __future__ import annotations

import multiprocessing
import queue
import threading

from serve.rpc.engine_host import BATCH_MESSAGES, _send_all, receive_all


def _frames(messages: list) -> list[list]:
    """Runs the sender over a real pipe with `messages` queued before it starts; the frames read back."""
    front, engine = multiprocessing.Pipe(duplex=True)
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    for m in messages:
        outbox.put(m)
    outbox.put(None)
    sender = threading.Thread(target=_send_all, args=(engine, outbox))
    sender.start()
    frames = []
    while sum(map(len, frames)) < len(messages):
        frames.append(receive_all(front))
    sender.join(5)
    assert not sender.is_alive()
    return frames


def test_queued_events_cross_in_few_writes_in_their_order():
    events = [("event", f"r{i % 7}", {"type": "token", "n": i}) for i in range(1200)]
    frames = _frames([("ready", {})] + events)
    assert frames[0] == [("ready", {})]  # the first message alone: the front end reads it before its router starts
    assert [m for f in frames[1:] for m in f] == events
    assert len(frames) - 1 == -(-len(events) // BATCH_MESSAGES)  # 1,200 events in 3 writes, not 1,200


def test_an_answer_that_cannot_cross_becomes_an_error_and_the_rest_still_goes():
    unpicklable = threading.Lock()
    messages = [("ready", {}), ("event", "a", {"type": "token"}), ("reply", 3, True, unpicklable),
                ("event", "b", {"type": "final"})]
    got = [m for f in _frames(messages) for m in f]
    assert got[0] == ("ready", {}) and got[1] == messages[1] and got[3] == messages[3]
    kind, call_id, ok, value = got[2]
    assert (kind, call_id, ok) == ("reply", 3, False) and isinstance(value, RuntimeError) and "lock" in str(value)


def test_the_front_ends_commands_cross_in_few_writes_in_their_order():
    from serve.rpc.engine_host import dumps, write_batches

    front, engine = multiprocessing.Pipe(duplex=True)
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    commands = [("abort", f"r{i}") for i in range(700)] + [("stop",)]
    for c in commands:
        outbox.put(dumps(c))  # the callers pickle (EngineProcess._send), the writer joins
    outbox.put(None)
    writer = threading.Thread(target=write_batches, args=(front, outbox, bytes))
    writer.start()
    frames = []
    while sum(map(len, frames)) < len(commands):
        frames.append(receive_all(engine))
    writer.join(5)
    assert [m for f in frames for m in f] == commands and len(frames) == 2  # 512 + 189, no first-alone here
