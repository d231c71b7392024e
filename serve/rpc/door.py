"""The unauthenticated door: sockets wait for their token line here, without a thread each.

The accept loop's own thread runs a selector over the listener and every pending socket. A pending
socket only collects its handshake line (`VLORA-AUTH/1 <token>\\n`, serve.rpc.auth); once the line
is whole the socket is handed on (to a thread that checks the token and then serves RPyC), so
a thousand idle sockets cost a thousand descriptors at most for a second, never a thread or a
connection slot. Bytes after the newline stay in the kernel's buffer for RPyC: the line is read
with a peek first and only up to its newline.

Bounds, so that idle sockets from one address never lock out clients from another:
- a pending socket must send its first byte within `first_byte_timeout_s` and its whole line
  within `handshake_timeout_s` (a deadline for the line, not per read: trickling cannot stay);
- at most `max_per_address` sockets of one source address wait at once, and `max_total` of all;
  a new socket past either bound first drops the waiting socket that has been idle longest
  (no byte for the longest time, of that address, or of the address holding the most), so a
  flood, however fast it reopens, only ever displaces its own oldest sockets and a newcomer is
  always let in. A socket about to be dropped is read first: if its whole line has arrived it
  passes instead.
"""

from __future__ import annotations

import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from .auth import MAX_LINE

READ_CHUNK = MAX_LINE + 1  # one more than a line may hold: a longer one is refused, not waited on
ACCEPTS_PER_WAKE = 64  # sockets accepted per wake before pending lines are read again


@dataclass(eq=False)
class Pending:
    sock: socket.socket
    address: str
    accepted: float
    last_byte: float | None = None
    line: bytearray = field(default_factory=bytearray)

    @property
    def idle_since(self) -> float:
        return self.accepted if self.last_byte is None else self.last_byte


class HandshakeDoor:
    """Pending handshakes of one listener; `wait(timeout)` is the accept loop's one step.

    `on_line(sock, line)`: a socket whose line (without the newline) arrived, now blocking and out
    of the door's hands. `on_drop(reason)`: the door closed a socket; reason is a key of `counters`.
    `on_accept_error(exc)`: accept() failed (e.g. EMFILE); the loop goes on.
    """

    def __init__(self, listener: socket.socket, on_line: Callable, on_drop: Callable, on_accept_error: Callable,
                 max_total: int, max_per_address: int, first_byte_timeout_s: float, handshake_timeout_s: float):
        self.check(max_total, max_per_address, first_byte_timeout_s, handshake_timeout_s)
        self.listener, self.on_line, self.on_drop, self.on_accept_error = listener, on_line, on_drop, on_accept_error
        self.max_total, self.max_per_address = max_total, max_per_address
        self.handshake_timeout_s = handshake_timeout_s
        self.first_byte_timeout_s = min(first_byte_timeout_s, handshake_timeout_s)
        self.pending: dict[socket.socket, Pending] = {}
        self.per_address: dict[str, int] = {}
        self.counters = {"handshakes_passed": 0, "handshakes_displaced": 0, "handshakes_timed_out": 0,
                         "handshakes_too_long": 0, "handshakes_closed": 0}
        listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ)

    @staticmethod
    def check(max_total: int, max_per_address: int, first_byte_timeout_s: float, handshake_timeout_s: float) -> None:
        for name, value in (("rpc.max_handshakes", max_total), ("rpc.max_handshakes_per_address", max_per_address)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        for name, value in (("rpc.first_byte_timeout_s", first_byte_timeout_s),
                            ("rpc.handshake_timeout_s", handshake_timeout_s)):
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ValueError(f"{name}={value!r}: must be a positive number of seconds")

    # ---- the loop's step -----------------------------------------------------------------------
    def wait(self, timeout: float) -> None:
        """Waits up to `timeout` s (less when a pending deadline comes first), then accepts new
        sockets, reads pending lines and drops sockets past their deadlines."""
        now = time.monotonic()
        next_deadline = min((self._deadline(p) for p in self.pending.values()), default=now + timeout)
        events = self._selector.select(max(0.0, min(timeout, next_deadline - now)))
        for key, _ in events:
            if key.fileobj is self.listener:
                self._accept_some()
            else:
                pending = self.pending.get(key.fileobj)
                if pending is not None:
                    self._read(pending)
        self._expire(time.monotonic())

    def close(self) -> None:
        for pending in list(self.pending.values()):
            self._forget(pending)
            pending.sock.close()
        self._selector.close()

    # ---- admission -----------------------------------------------------------------------------
    def _accept_some(self) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, peer = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE, ENFILE, ENOBUFS...: the caller logs and pauses
                self.on_accept_error(e)
                return
            self._admit(sock, str(peer[0]) if isinstance(peer, tuple) else "local")

    def _admit(self, sock: socket.socket, address: str) -> None:
        if self.per_address.get(address, 0) >= self.max_per_address:
            self._displace(address)
        if len(self.pending) >= self.max_total:  # from the address holding the most: a flood from one
            self._displace(max(self.per_address, key=lambda a: (self.per_address[a], a == address)))
        sock.setblocking(False)
        pending = Pending(sock, address, time.monotonic())
        self.pending[sock] = pending
        self.per_address[address] = self.per_address.get(address, 0) + 1
        self._selector.register(sock, selectors.EVENT_READ)
        self._read(pending)  # a real client's line is usually there already: no wait for the next wake

    def _displace(self, address: str) -> None:
        """Drops the socket of `address` idle longest to make room. Past the total bound the address
        holding the most pending sockets gives one up, so a flood from one address cannot displace
        a client from another however fast it reopens (the longest idle of all had been taken, and a
        socket reopened 11,000 times a second evicted a real client's before its line arrived)."""
        candidates = [p for p in self.pending.values() if p.address == address]
        if not candidates:
            return
        oldest = min(candidates, key=lambda p: (p.idle_since, p.accepted))
        # its line may be in the kernel's buffer, unread: a wake admits up to ACCEPTS_PER_WAKE sockets before it
        # reads, and a flood from more addresses than max_total displaced a real client's socket whose line had
        # arrived. Read it first: a whole line passes (making the room), anything less is dropped.
        self._read(oldest)
        if oldest.sock in self.pending:
            self._drop(oldest, "handshakes_displaced")

    # ---- reading lines -------------------------------------------------------------------------
    def _read(self, pending: Pending) -> None:
        try:
            peeked = pending.sock.recv(READ_CHUNK - len(pending.line), socket.MSG_PEEK)
            if not peeked:
                return self._drop(pending, "handshakes_closed")  # closed before finishing its line
            newline = peeked.find(b"\n")
            # consume only up to the newline: what follows belongs to RPyC
            pending.line += pending.sock.recv(len(peeked) if newline < 0 else newline + 1)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return self._drop(pending, "handshakes_closed")
        pending.last_byte = time.monotonic()
        if pending.line.endswith(b"\n"):
            self._forget(pending)
            pending.sock.setblocking(True)
            self.counters["handshakes_passed"] += 1
            self.on_line(pending.sock, bytes(pending.line[:-1]))
        elif len(pending.line) > MAX_LINE:
            self._drop(pending, "handshakes_too_long")
        return None

    # ---- deadlines and dropping ----------------------------------------------------------------
    def _deadline(self, pending: Pending) -> float:
        if pending.last_byte is None:
            return pending.accepted + self.first_byte_timeout_s
        return pending.accepted + self.handshake_timeout_s

    def _expire(self, now: float) -> None:
        for pending in [p for p in self.pending.values() if self._deadline(p) <= now]:
            self._drop(pending, "handshakes_timed_out")

    def _forget(self, pending: Pending) -> None:
        del self.pending[pending.sock]
        left = self.per_address[pending.address] - 1
        if left:
            self.per_address[pending.address] = left
        else:
            del self.per_address[pending.address]
        try:
            self._selector.unregister(pending.sock)
        except (KeyError, ValueError):
            pass

    def _drop(self, pending: Pending, reason: str) -> None:
        self.counters[reason] += 1
        self._forget(pending)
        try:
            pending.sock.close()
        except OSError:
            pass
        self.on_drop(reason)
