"""RPyC's threaded server with its doors guarded: before the token, around each message, and idle.

- Before the token: accepted sockets wait in serve.rpc.door (a selector on the accept loop's
  thread, bounded per source address and in total, with a first-byte and a whole-line deadline);
  only a socket whose handshake line arrived gets a thread, which checks the token and serves.
- Accepting never ends but by close(): RPyC ended its accept loop on any accept() error other
  than EINTR/EAGAIN (EMFILE from a flood stopped the server with exit status 0); here the error is
  logged (at most once a second) and accepting resumes after a short pause.
- After the token: serve.rpc.connections serves the connection (each message's size bounded, idle
  connections closed, introspection sealed), on this process's thread, or in the tenant's own
  front-end process when `hand_off(sock, tenant)` takes the socket (serve/rpc/tenant_processes.py).
"""

from __future__ import annotations

import socket
import threading
import time

from rpyc.utils.authenticators import AuthenticationError
from rpyc.utils.server import ThreadedServer

from .connections import BoundedChannel, ConnectionRunner, PatientStream  # noqa: F401 - their old home
from .door import HandshakeDoor
from .logs import clip

ACCEPT_PAUSE_S = 0.05  # after a failed accept (e.g. EMFILE: out of descriptors) before the next one
WAKE_S = 0.5  # the accept loop's longest wait: close() is seen within this


class _LineAlreadyRead:
    """The socket as the token check sees it: the door read the handshake line, recv() replays it."""

    def __init__(self, sock: socket.socket, line: bytes):
        self._sock, self._rest = sock, line + b"\n"

    def recv(self, n: int) -> bytes:
        if not self._rest:
            return self._sock.recv(n)
        out, self._rest = self._rest[:n], self._rest[n:]
        return out

    def __getattr__(self, name):  # settimeout, sendall, getpeername...: the real socket's
        return getattr(self._sock, name)


class GuardedServer(ThreadedServer):
    def __init__(self, *args, max_handshakes: int = 64, max_handshakes_per_address: int = 16,
                 first_byte_timeout_s: float = 1.0, handshake_timeout_s: float = 5.0, idle_timeout_s: float = 300.0,
                 max_message_bytes: int = 64 << 20, **kwargs):
        # bad settings are refused before the port is bound, each naming its key
        HandshakeDoor.check(max_handshakes, max_handshakes_per_address, first_byte_timeout_s, handshake_timeout_s)
        if not (isinstance(idle_timeout_s, (int, float)) and 0 < idle_timeout_s < float("inf")):
            raise ValueError(f"rpc.idle_timeout_s={idle_timeout_s!r}: must be a positive number of seconds")
        super().__init__(*args, **kwargs)
        self.max_message_bytes, self.idle_timeout_s = max_message_bytes, idle_timeout_s
        self.runner = ConnectionRunner(self.service, self.protocol_config, self.logger, max_message_bytes,
                                       idle_timeout_s)
        # hand_off(sock, credentials) -> True when another process serves the socket from now on
        self.hand_off = None
        self.door = HandshakeDoor(self.listener, self._hand_over, self._dropped, self._accept_failed,
                                  max_handshakes, max_handshakes_per_address, first_byte_timeout_s,
                                  handshake_timeout_s)
        self._looping = False
        self.accept_errors = 0

    @property
    def idle_closed(self) -> int:
        return self.runner.idle_closed

    def _warn(self, message: str) -> None:
        self.runner.warn(message)

    # ---- the accept loop (RPyC's start() calls accept() while active) ----------------------------
    def accept(self):
        self._looping = True
        try:
            self.door.wait(WAKE_S)
        except Exception as e:  # only close() may end the loop (RPyC's start() would stop on anything)
            self._warn(f"accept loop: {clip(f'{type(e).__name__}: {e}')}")
            time.sleep(ACCEPT_PAUSE_S)
        if not self.active:  # closed meanwhile: pending sockets go with the loop, on its own thread
            self.door.close()

    def close(self):
        super().close()
        if not self._looping:  # never served: no loop to close the door (its selector) behind it
            self.door.close()

    def _accept_failed(self, error: OSError) -> None:
        if not self.active:  # the listener was closed under the loop: no failure
            return
        self.accept_errors += 1
        self._warn(f"accept failed ({type(error).__name__}: {error}); pausing {ACCEPT_PAUSE_S * 1e3:.0f} ms")
        time.sleep(ACCEPT_PAUSE_S)

    def _dropped(self, reason: str) -> None:
        if reason == "handshakes_displaced":
            self._warn("too many sockets in their handshake (of one address, or in all): "
                       "dropping the one idle longest for each new one")

    def _hand_over(self, sock: socket.socket, line: bytes) -> None:
        self.clients.add(sock)  # close() shuts it down from here on
        try:
            threading.Thread(target=self._authenticate_and_serve, args=(sock, line), daemon=True).start()
        except RuntimeError as e:  # no thread to be had: this one socket goes, the server stays
            self._warn(f"cannot start a connection thread ({e}); closing the connection")
            self.clients.discard(sock)
            sock.close()

    # ---- one connection's thread -----------------------------------------------------------------
    def _authenticate_and_serve(self, sock: socket.socket, line: bytes) -> None:
        handed = False
        try:
            try:
                _, credentials = self.authenticator(_LineAlreadyRead(sock, line))
            except AuthenticationError:
                return
            handed = self.hand_off is not None and self.hand_off(sock, credentials)
            if not handed:
                self.runner.serve(sock, credentials)
        except Exception as e:  # a client's malformed protocol: one clipped line, no traceback per message
            self._warn(f"connection ended: {clip(f'{type(e).__name__}: {e}')}")
        finally:
            if not handed:  # a handed-off socket is another process's now: only this process's copy closes
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            sock.close()
            self.clients.discard(sock)
