"""The HTTP listener's door: connections without a request in progress, bounded so that idle or
trickling sockets from one address never lock out a client from another, nor one tenant's another.

uvicorn with h11 keeps open a connection that never sends a byte, and one that sends a byte every
few seconds (any byte stops its keep-alive timer); each counts towards its concurrency backstop,
past which every request is answered 503, so 600 idle sockets would refuse everyone. The door keeps
the connections *waiting*: accepted, or done with a response, and without a whole request head yet.

- Deadlines: the first byte within `first_byte_timeout_s` of the accept (`keep_alive_s` after a
  response), the whole head within `header_timeout_s` of its first byte (a deadline for the head,
  not per read: trickling cannot stay). Past one the connection is closed, with a 408 when part of
  a request had come.
- Groups: a connection whose last request carried a tenant's token waits among that tenant's,
  any other among its source address's.
- Bounds: at most `max_pending` wait in all. A connection past it first closes the connection
  waiting longest in the group holding the most (on a tie its own), so a flood, however fast it
  reopens, only ever displaces its own sockets, and a newcomer is always let in. An address's
  connections past `max_pending_per_address` close its own that waits longest, but only one
  waiting `GRACE_S` or more: a client opening many connections at once is let in before any sent.
- A connection whose bytes wait unread in the kernel is about to start a request (a wake accepts
  many sockets before it reads them): it is displaced last, and past the per-address bound not
  at all.
- An address that started a request within the last `first_byte_timeout_s` is a live client
  opening several connections at once, not a pile of idle sockets: past its bound its connections
  wait out their first-byte deadline instead of the grace. A busy client's event loop can take
  longer than `GRACE_S` to write on each of 64 sockets it opened together (5 of 64 such
  connections were closed on a loaded 2-core machine). It cannot lock anyone out this way: the
  bound in all still takes from the group holding the most.

One event loop runs every protocol of the listener: no locks.
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

from .errors import error_body

ADDRESS, TENANT = "address", "tenant"
GRACE_S = 0.25  # an address's connection waiting less than this is not displaced by the per-address bound


@dataclass(eq=False)
class Waiting:
    proto: Any  # the connection's protocol (its .transport)
    group: tuple[str, str]
    since: float  # accepted, or its last response done
    fresh: bool  # no request on it yet
    first_byte: float | None = None
    timer: asyncio.TimerHandle | None = None


class HttpDoor:
    def __init__(self, max_pending: int, max_pending_per_address: int, first_byte_timeout_s: float,
                 header_timeout_s: float, keep_alive_s: float, count: Callable[[str], None]):
        self.max_pending, self.max_pending_per_address = max_pending, max_pending_per_address
        self.first_byte_timeout_s, self.header_timeout_s = first_byte_timeout_s, header_timeout_s
        self.keep_alive_s, self.count = keep_alive_s, count
        self.waiting: dict[Any, Waiting] = {}
        self.groups: dict[tuple[str, str], int] = {}
        self.progress: dict[str, float] = {}  # address -> when a request of its last started
        self.prune_at = 4 * max_pending  # the size of `progress` that prunes it next

    # ---- what the protocol tells ---------------------------------------------------------------
    def arrived(self, proto, address: str) -> None:
        """A connection accepted: it waits for its first request, among its address's."""
        self._wait(proto, (ADDRESS, address), fresh=True)

    def answered(self, proto, tenant=None) -> None:
        """A response done and the connection kept alive: it waits for the next request, among the
        connections of the tenant whose token its last request carried, else of its address."""
        group = (TENANT, tenant.name) if tenant is not None else (ADDRESS, getattr(proto, "door_address", "?"))
        self._wait(proto, group, fresh=False)

    def heard(self, proto) -> None:
        """Bytes came: the head's deadline starts at the first of them."""
        waiting = self.waiting.get(proto)
        if waiting is not None and waiting.first_byte is None:
            waiting.first_byte = time.monotonic()
            self._schedule(waiting)

    def started(self, proto) -> None:
        """A request's head is whole: the connection is the app's until its response is done. (Told on
        every read of the request; only the first, while the connection still waits, counts.)"""
        waiting = self.waiting.get(proto)
        if waiting is not None:
            self._progressed(getattr(proto, "door_address", None))
            self._forget(waiting)

    def gone(self, proto) -> None:
        """Closed, by either side."""
        waiting = self.waiting.get(proto)
        if waiting is not None:
            self._forget(waiting)

    # ---- bounds --------------------------------------------------------------------------------
    def _wait(self, proto, group: tuple[str, str], fresh: bool) -> None:
        old = self.waiting.get(proto)
        if old is not None:
            self._forget(old)
        if (group[0] == ADDRESS and self.groups.get(group, 0) >= self.max_pending_per_address
                and not self._live(group[1])):
            self._displace(group, min_wait_s=GRACE_S)
        if len(self.waiting) >= self.max_pending:  # the group holding the most gives one up; on a tie its own
            self._displace(max(self.groups, key=lambda g: (self.groups[g], g == group)))
        waiting = Waiting(proto, group, time.monotonic(), fresh)
        self.waiting[proto] = waiting
        self.groups[group] = self.groups.get(group, 0) + 1
        self._schedule(waiting)

    def _displace(self, group: tuple[str, str], min_wait_s: float | None = None) -> None:
        """Closes the connection of `group` waiting longest (a trickling head waits as long as an idle
        socket): one with nothing unread if there is one; with `min_wait_s`, only one waiting at least
        that long, else none."""
        now = time.monotonic()
        candidates = [w for w in self.waiting.values() if w.group == group
                      and (min_wait_s is None or now - w.since >= min_wait_s)]
        if not candidates:
            return
        candidates.sort(key=lambda w: w.since)
        quiet = next((w for w in candidates if not _unread(w.proto)), None)
        if quiet is None and min_wait_s is not None:
            return  # every one has a request arriving: over the address's bound for a moment
        self._drop(quiet or candidates[0], "http_door_displaced")

    def _progressed(self, address: str | None) -> None:
        if address is None:
            return
        now = time.monotonic()
        self.progress[address] = now
        if len(self.progress) > self.prune_at:  # many addresses: keep the ones still live
            self.progress = {a: t for a, t in self.progress.items() if now - t < self.first_byte_timeout_s}
            # next prune once it has doubled: with many live addresses, a rebuild per request start
            # would cost their number each time; this way each start pays for at most two entries
            self.prune_at = max(4 * self.max_pending, 2 * len(self.progress))

    def _live(self, address: str) -> bool:
        """Whether a request from `address` started within the last first-byte deadline."""
        last = self.progress.get(address)
        return last is not None and time.monotonic() - last < self.first_byte_timeout_s

    # ---- deadlines -----------------------------------------------------------------------------
    def _deadline(self, waiting: Waiting) -> float:
        if waiting.first_byte is not None:
            return waiting.first_byte + self.header_timeout_s
        return waiting.since + (self.first_byte_timeout_s if waiting.fresh else self.keep_alive_s)

    def _schedule(self, waiting: Waiting) -> None:
        if waiting.timer is not None:
            waiting.timer.cancel()
        delay = max(0.0, self._deadline(waiting) - time.monotonic())
        waiting.timer = asyncio.get_running_loop().call_later(delay, self._expire, waiting)

    def _expire(self, waiting: Waiting) -> None:
        if self.waiting.get(waiting.proto) is not waiting:
            return  # started or gone since
        if time.monotonic() < self._deadline(waiting):
            return self._schedule(waiting)
        if waiting.first_byte is None:
            return self._drop(waiting, "http_door_idle_closed")
        body = json.dumps(error_body("timeout", f"the request's head did not arrive within "
                                                f"{self.header_timeout_s:g} s of its first byte (http.header_timeout_s)"))
        head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                f"content-length: {len(body)}\r\n\r\n")
        try:
            waiting.proto.transport.write((head + body).encode())
        except Exception:  # the socket is going anyway
            pass
        self._drop(waiting, "http_door_header_timeouts")

    # ---- forgetting and closing ----------------------------------------------------------------
    def _forget(self, waiting: Waiting) -> None:
        del self.waiting[waiting.proto]
        left = self.groups[waiting.group] - 1
        if left:
            self.groups[waiting.group] = left
        else:
            del self.groups[waiting.group]
        if waiting.timer is not None:
            waiting.timer.cancel()

    def _drop(self, waiting: Waiting, reason: str) -> None:
        self._forget(waiting)
        self.count(reason)
        waiting.proto.transport.close()


def _unread(proto) -> bool:
    """Whether bytes of the connection wait in the kernel, not read by the loop yet (Linux, macOS)."""
    try:
        import fcntl
        import termios

        fd = proto.transport.get_extra_info("socket").fileno()
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0] > 0
    except Exception:  # no socket (closing) or no FIONREAD: count it idle
        return False


def door_protocol(door: HttpDoor):
    """uvicorn's h11 protocol, telling `door` when a connection waits, hears, starts a request or goes."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DoorProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.door_address = self.client[0] if self.client else "local"
            door.arrived(self, self.door_address)

        def data_received(self, data: bytes) -> None:
            door.heard(self)
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                door.started(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request's cycle
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                door.answered(self, (self.scope or {}).get("state", {}).get("tenant"))

        def connection_lost(self, exc) -> None:
            door.gone(self)
            super().connection_lost(exc)

    return DoorProtocol
