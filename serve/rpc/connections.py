"""One authenticated connection, served: RPyC's protocol over a bounded channel and a patient stream,
its calls taking turns at the gate, closed when idle. The accept loop's threads run it
(serve/rpc/guarded.py), and so does a tenant's front-end process for the sockets handed to it
(serve/rpc/tenant_processes.py).

- Each message: BoundedChannel refuses one over the size limit before reading or inflating it.
- Idle: an authenticated connection that sends no message for `idle_timeout_s` is closed (a call
  in progress, such as a long poll, is not idle), and so is one whose message, once begun, does
  not come whole within that time or that stops reading its replies, so token holders cannot
  sit on connection slots.
- The connection is serve.rpc.sealed's: introspection answers nothing about the server.
"""

from __future__ import annotations

import socket
import time
import zlib

from rpyc.core.channel import Channel
from rpyc.core.stream import SocketStream

from .gate import GATE
from .sealed import SealedConnection


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


class ConnectionRunner:
    """Serves authenticated sockets: `serve(sock, credentials)` returns when the connection ends.
    service(): a new service instance per connection; `warn(message)`: the process's warnings about
    connections, at most one a second."""

    def __init__(self, service, protocol_config: dict, logger, max_message_bytes: int, idle_timeout_s: float):
        self.service, self.protocol_config, self.logger = service, protocol_config, logger
        self.max_message_bytes, self.idle_timeout_s = max_message_bytes, idle_timeout_s
        self.idle_closed = 0
        self._last_warning = 0.0

    def warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 1.0:  # a flood must not flood the log too
            self._last_warning = now
            self.logger.warning(message)

    def serve(self, sock: socket.socket, credentials) -> None:
        # RPyC's own, with the bounded channel and the sealed connection (Service._connect's steps)
        config = dict(self.protocol_config, credentials=credentials,
                      endpoints=(sock.getsockname(), sock.getpeername()), logger=self.logger)
        channel = BoundedChannel(PatientStream(sock, self.idle_timeout_s), self.max_message_bytes,
                                 lambda why: self.warn(f"connection closed: {why}"))
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
