"""Token authentication, done on the raw socket before RPyC speaks a byte.

The client sends one line `VLORA-AUTH/1 <token>\\n`; the server answers `OK`, `DENIED` or
`BUSY` (connection limit) and closes on anything but OK. The token names the tenant (serve.rpc.tenants);
its digest is compared in constant time.
A connection that does not finish the handshake within `timeout_s` in total is dropped (a deadline
for the whole line, not per read: a socket trickling a byte a second cannot stay), and the server
bounds how many handshakes run at once (serve.rpc.server), so idle sockets cannot hold threads.
"""

from __future__ import annotations

import socket
import time

from rpyc.utils.authenticators import AuthenticationError

MAGIC = b"VLORA-AUTH/1 "
MAX_LINE = 1024


class AuthError(ConnectionError):
    """The server refused the connection (wrong token, or too many connections)."""


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

    def __init__(self, tenants, admit=None, timeout_s: float = 5.0):
        from .tenants import TenantRegistry

        self.tenants = TenantRegistry.single(tenants) if isinstance(tenants, str) or tenants is None else tenants
        self._admit = admit or (lambda tenant: True)
        self.timeout_s = timeout_s

    def __call__(self, sock: socket.socket):
        try:
            line = _read_line(sock, time.monotonic() + self.timeout_s)
        except (OSError, ValueError) as e:
            raise AuthenticationError(f"bad handshake: {e}") from None
        tenant = self.tenants.identify(line[len(MAGIC):]) if line.startswith(MAGIC) else None
        if tenant is None:
            _send(sock, b"DENIED\n")
            raise AuthenticationError("wrong token")
        if not self._admit(tenant):
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
