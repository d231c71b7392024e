"""serve/rpc/door.py's HandshakeDoor on a real loopback listener: a socket about to be displaced by a flood from
more addresses than the door has room for is read first, so a client whose line has arrived passes instead of
being dropped (a wake admits up to ACCEPTS_PER_WAKE sockets before it reads the pending ones)."""

from __future__ import annotations

import socket
import time

import pytest

from serve.rpc.door import HandshakeDoor

VICTIM = "127.0.0.3"
FLOOD = [f"127.0.1.{i}" for i in range(1, 9)]  # 8 addresses, one socket each: more than the door's 4 slots


def _connect(port: int, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


@pytest.fixture
def door():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        _connect(listener.getsockname()[1], FLOOD[0]).close()
    except OSError as e:
        listener.close()
        pytest.skip(f"loopback aliases ({FLOOD[0]}) are not usable here: {e}")
    passed = []
    d = HandshakeDoor(listener, on_line=lambda sock, line: passed.append((sock, line)), on_drop=lambda reason: None,
                      on_accept_error=lambda e: None, max_total=4, max_per_address=16, first_byte_timeout_s=5.0,
                      handshake_timeout_s=5.0)
    d.wait(0.05)  # the probe connection above: accepted, then closed
    d.passed = passed  # the counters say what was dropped
    yield d
    for sock, _ in passed:
        sock.close()
    d.close()
    listener.close()


def _accepted(door: HandshakeDoor, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(door.pending) < count and time.monotonic() < deadline:
        door.wait(0.05)


def test_a_client_whose_line_arrived_passes_instead_of_being_displaced(door):
    port = door.listener.getsockname()[1]
    victim = _connect(port, VICTIM)
    _accepted(door, 1)  # accepted before its line: it waits in the door
    victim.sendall(b"VLORA-AUTH/1 token\n")
    flood = [_connect(port, a) for a in FLOOD]
    time.sleep(0.2)  # the victim's line and every flood socket are in the kernel's queues
    door._accept_some()  # the listener's event handled first in a wake: 8 admissions past the 4 slots
    try:
        assert [line for _, line in door.passed] == [b"VLORA-AUTH/1 token"]
        assert door.counters["handshakes_passed"] == 1
        # 3 of the 8 filled the room left; the 4th's room was made by the victim passing, the last 4 displaced
        assert door.counters["handshakes_displaced"] == len(FLOOD) - 4
        assert len(door.pending) == 4 and all(p.address in FLOOD for p in door.pending.values())
    finally:
        victim.close()
        for s in flood:
            s.close()


def test_a_silent_socket_is_still_displaced(door):
    port = door.listener.getsockname()[1]
    silent = _connect(port, VICTIM)
    _accepted(door, 1)
    flood = [_connect(port, a) for a in FLOOD]
    time.sleep(0.2)
    door._accept_some()
    try:
        assert door.passed == [] and VICTIM not in door.per_address
        assert door.counters["handshakes_displaced"] == len(FLOOD) + 1 - 4
    finally:
        silent.close()
        for s in flood:
            s.close()
