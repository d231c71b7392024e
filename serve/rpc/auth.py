"""Token authentication, done on the raw socket before RPyC speaks a byte.

The client sends one line `VLORA-AUTH/1 <token>\\n`; the server answers `OK`, `DENIED` or
`BUSY` (connection limit) and closes on anything but OK. The token names the tenant (serve.rpc.tenants);
its digest is compared in constant time.
A connection that does not finish the handshake within `timeout_s` in total is dropped (a deadline
for the whole line, not per read: a socket trickling a byte a second cannot stay), and the server
bounds how many handshakes run at once (serve.rpc.server), so idle sockets cannot hold threads.

Every refusal is logged (logger `vlora.serve.rpc.auth`, WARNING) with the source address and the
reason, never the token: at most one line per source address every `RefusalLog.every_s` seconds,
the next one saying how many were refused meanwhile, so a client retrying a wrong token (or a
scanner) cannot flood the log.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from rpyc.utils.authenticators import AuthenticationError

MAGIC = b"VLORA-AUTH/1 "
MAX_LINE = 1024


class AuthError(ConnectionError):
    """The server refused the connection (wrong token, or too many connections)."""


class RefusalLog:
    """One log line per source address per `every_s` seconds; refusals in between are counted and
    told on the next line. Remembers at most `max_addresses` addresses (the oldest are forgotten)."""

    def __init__(self, logger: logging.Logger | None = None, every_s: float = 10.0, max_addresses: int = 4096):
        self.logger = logger or logging.getLogger("vlora.serve.rpc.auth")
        self.every_s, self.max_addresses = every_s, max_addresses
        self._seen: dict[str, list] = {}  # address -> [time of its last line, refusals not logged since]
        self._lock = threading.Lock()  # connection threads refuse at once

    def refused(self, address: str, reason: str) -> bool:
        """Logs (or counts) one refusal; True when a line was written."""
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(address)
            if seen is not None and now - seen[0] < self.every_s:
                seen[1] += 1
                return False
            if len(self._seen) >= self.max_addresses:  # forget the address whose last line is oldest
                del self._seen[min(self._seen, key=lambda a: self._seen[a][0])]
            self._seen[address] = [now, 0]
            quiet = seen[1] if seen is not None else 0
        more = f" ({quiet} more refused from it in the last {self.every_s:g} s, not logged)" if quiet else ""
        self.logger.warning("refused a connection from %s: %s%s", address, reason, more)
        return True


def _peer(sock) -> str:
    try:
        peer = sock.getpeername()
    except OSError:
        return "an unknown address"
    return str(peer[0]) if isinstance(peer, tuple) else str(peer) or "a local socket"


def _read_line(sock: socket.socket, deadline: float | None = None) -> bytes:
    """One line from `sock`; with a deadline (time.monotonic()), the whole line must arrive by then."""
    line = bytearray()
    while len(line) <= MAX_LINE:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("handshake not finished in time")
            sock.settimeout(left)
        byte = sock.recv(1)  # one byte at a time: nothing after the newline may be consumed here
        if not byte:
            raise ConnectionError("connection closed during the handshake")
        if byte == b"\n":
            return bytes(line)
        line += byte
    raise ValueError("handshake line too long")


class TokenAuthenticator:
    """RPyC authenticator: `ThreadedServer(..., authenticator=TokenAuthenticator(tenants, admit))`.

    `tenants`: a TenantRegistry (serve.rpc.tenants), or one token string (its holder is the
    operator). The connection's credentials are the Tenant whose token it sent.
    `admit(tenant)` is asked after a good token whether one more connection of that tenant fits;
    it returns False when the server or the tenant is at its connection limit.
    """

    def __init__(self, tenants, admit=None, timeout_s: float = 5.0, refusals: RefusalLog | None = None):
        from .tenants import TenantRegistry

        self.tenants = TenantRegistry.single(tenants) if isinstance(tenants, str) or tenants is None else tenants
        self._admit = admit or (lambda tenant: True)
        self.timeout_s = timeout_s
        self.refusals = refusals or RefusalLog()

    def __call__(self, sock: socket.socket):
        try:
            line = _read_line(sock, time.monotonic() + self.timeout_s)
        except (OSError, ValueError) as e:
            self.refusals.refused(_peer(sock), f"bad handshake ({e})")
            raise AuthenticationError(f"bad handshake: {e}") from None
        if not line.startswith(MAGIC):  # the line itself is not logged: it may hold a token
            self.refusals.refused(_peer(sock), f"not a V-LoRA handshake (a {len(line)}-byte line without "
                                               f"{MAGIC.decode().strip()})")
            _send(sock, b"DENIED\n")
            raise AuthenticationError("bad protocol")
        tenant = self.tenants.identify(line[len(MAGIC):])
        if tenant is None:
            self.refusals.refused(_peer(sock), "wrong token")
            _send(sock, b"DENIED\n")
            raise AuthenticationError("wrong token")
        if not self._admit(tenant):
            self.refusals.refused(_peer(sock), f"at the connection limit (tenant {getattr(tenant, 'name', '?')})")
            _send(sock, b"BUSY\n")
            raise AuthenticationError("too many connections")
        _send(sock, b"OK\n")
        sock.settimeout(None)
        return sock, tenant


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass


def client_handshake(sock: socket.socket, token: str, timeout_s: float = 10.0) -> None:
    sock.settimeout(timeout_s)
    sock.sendall(MAGIC + token.encode() + b"\n")
    try:
        reply = _read_line(sock)
    except (OSError, ValueError) as e:
        raise AuthError(f"the server closed the connection during authentication ({e})") from None
    if reply == b"DENIED":
        raise AuthError("the server refused the token")
    if reply == b"BUSY":
        raise AuthError("the server is at its connection limit; try again later")
    if reply != b"OK":
        raise AuthError(f"unexpected handshake reply {reply[:40]!r}: is this a V-LoRA server?")
    sock.settimeout(None)
