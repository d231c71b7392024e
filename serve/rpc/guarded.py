"""RPyC's threaded server with its doors guarded: before the token, around each message, and idle.

- Before the token: accepted sockets wait in serve.rpc.door (a selector on the accept loop's
  thread, bounded per source address and in total, with a first-byte and a whole-line deadline);
  only a socket whose handshake line arrived gets a thread, which checks the token and serves.
- Accepting never ends but by close(): RPyC ended its accept loop on any accept() error other
  than EINTR/EAGAIN (EMFILE from a flood stopped the server with exit status 0); here the error is
  logged (at most once a second) and accepting resumes after a short pause.
- Each message: BoundedChannel refuses one over the size limit before reading or inflating it.
- Idle: an authenticated connection that sends no message for `idle_timeout_s` is closed (a call
  in progress, such as a long poll, is not idle), and so is one whose message, once begun, does
  not come whole within that time or that stops reading its replies, so token holders cannot
  sit on connection slots.
- The connection is serve.rpc.sealed's: introspection answers nothing about the server.
"""

from __future__ import annotations

import socket
import threading
import time
import zlib

from rpyc.core.channel import Channel
from rpyc.core.stream import SocketStream
from rpyc.utils.authenticators import AuthenticationError
from rpyc.utils.server import ThreadedServer

from .door import HandshakeDoor
from .gate import GATE
from .logs import clip
from .sealed import SealedConnection

ACCEPT_PAUSE_S = 0.05  # after a failed accept (e.g. EMFILE: out of descriptors) before the next one
WAKE_S = 0.5  # the accept loop's longest wait: close() is seen within this


class BoundedChannel(Channel):
    """RPyC's channel with the size limit applied as a message arrives, not after: the header's
    length is checked before the body is read, and a compressed body is inflated only up to the
    limit (RPyC inflates whatever comes: 2 MB of zeros on the wire became a 512 MB frame before
    any check). A message over the limit ends the connection; the server goes on."""

    __slots__ = ["max_bytes", "on_refused"]

    def __init__(self, stream, max_bytes: int, on_refused=None):
        super().__init__(stream)
        self.max_bytes, self.on_refused = max_bytes, on_refused

    def _refuse(self, why: str):
        if self.on_refused is not None:
            self.on_refused(why)
        return EOFError(why)  # RPyC's serve loop ends the connection on it, quietly

    def recv(self):
        try:
            return self._recv()
        finally:
            done = getattr(self.stream, "message_done", None)  # PatientStream's message deadline
            if done is not None and not self.stream.closed:
                done()

    def _recv(self):
        header = self.stream.read(self.FRAME_HEADER.size)
        length, compressed = self.FRAME_HEADER.unpack(header)
        if length > self.max_bytes:
            raise self._refuse(f"a message of {length} bytes exceeds the limit of {self.max_bytes}")
        data = self.stream.read(length + len(self.FLUSHER))[:-len(self.FLUSHER)]
        if compressed:
            inflate = zlib.decompressobj()
            data = inflate.decompress(data, self.max_bytes)
            if inflate.unconsumed_tail:
                raise self._refuse(f"a compressed message inflates past the limit of {self.max_bytes} bytes")
        return data


class PatientStream(SocketStream):
    """RPyC's socket stream with a deadline per message: once a message's first byte has come, the
    whole message must come within `patience_s` (RPyC retried a timed-out read forever, so half a
    message, then silence or a byte now and then, held a thread and a connection slot for good).
    A write that makes no progress for `patience_s` (a client that stops reading its replies)
    ends the connection too."""

    __slots__ = ("patience_s", "deadline")

    def __init__(self, sock: socket.socket, patience_s: float):
        super().__init__(sock)
        self.patience_s, self.deadline = patience_s, None
        sock.settimeout(patience_s)

    def read(self, count):
        if self.deadline is None:  # a message's first read
            self.deadline = time.monotonic() + self.patience_s
        chunks = []
        while count > 0:
            try:
                self.sock.settimeout(max(self.deadline - time.monotonic(), 1e-3))
                buf = self.sock.recv(min(self.MAX_IO_CHUNK, count))
            except OSError as e:  # TimeoutError among them: the message did not come whole in time
                self.close()
                raise EOFError(f"{type(e).__name__} while reading a message") from None
            if not buf:
                self.close()
                raise EOFError("connection closed by peer")
            chunks.append(buf)
            count -= len(buf)
        return b"".join(chunks)

    def message_done(self) -> None:
        self.deadline = None
        self.sock.settimeout(self.patience_s)  # for the replies' writes


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
        self.door = HandshakeDoor(self.listener, self._hand_over, self._dropped, self._accept_failed,
                                  max_handshakes, max_handshakes_per_address, first_byte_timeout_s,
                                  handshake_timeout_s)
        self._last_warning = 0.0
        self._looping = False
        self.accept_errors = 0
        self.idle_closed = 0

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 1.0:  # a flood must not flood the log too
            self._last_warning = now
            self.logger.warning(message)

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
        try:
            try:
                _, credentials = self.authenticator(_LineAlreadyRead(sock, line))
            except AuthenticationError:
                return
            self._serve_client(sock, credentials)
        except Exception as e:  # a client's malformed protocol: one clipped line, no traceback per message
            self._warn(f"connection ended: {clip(f'{type(e).__name__}: {e}')}")
        finally:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
            self.clients.discard(sock)

    def _serve_client(self, sock, credentials):
        # RPyC's own, with the bounded channel and the sealed connection (Service._connect's steps)
        config = dict(self.protocol_config, credentials=credentials,
                      endpoints=(sock.getsockname(), sock.getpeername()), logger=self.logger)
        channel = BoundedChannel(PatientStream(sock, self.idle_timeout_s), self.max_message_bytes,
                                 lambda why: self._warn(f"connection closed: {why}"))
        service = self.service()
        conn = SealedConnection(service, channel, config)
        service.on_connect(conn)
        dispatch = conn._dispatch

        def gated(data):  # RPyC's own work on a message (unboxing, the reply) takes a turn at the gate too
            tenant = service.tenant
            with GATE.call(service.conn_id, getattr(tenant, "name", None), getattr(tenant, "weight", 1.0)):
                return dispatch(data)

        conn._dispatch = gated
        self._serve_until_idle(conn, sock)

    def _serve_until_idle(self, conn, sock: socket.socket) -> None:
        """RPyC's serve_all, ending the connection once no message came for idle_timeout_s."""
        last_message = time.monotonic()
        try:
            while not conn.closed:
                left = last_message + self.idle_timeout_s - time.monotonic()
                if left <= 0:
                    self.idle_closed += 1
                    try:  # shut the socket first: RPyC's close() would wait for the idle client's answer
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    break
                if conn.serve(left):  # True once a message was handled (a long poll: after its reply)
                    last_message = time.monotonic()
        except EOFError:
            pass
        finally:
            conn.close()
