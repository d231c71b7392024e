"""The RPyC server around one engine: restricted protocol, token authentication, limits.

    server = RpcServer(engine, token="...", port=0).start()   # a background thread
    print(server.port); ...; server.close()

RPyC runs in its restricted mode: only `exposed_` methods of the service are reachable, no
public-attribute access, no pickling, no custom exception classes and no server tracebacks in
replies. Classic mode (remote `eval`, module access) is never offered.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import zlib

from rpyc.core.channel import Channel
from rpyc.core.stream import SocketStream
from rpyc.utils.authenticators import AuthenticationError
from rpyc.utils.helpers import classpartial
from rpyc.utils.server import ThreadedServer

from .auth import TokenAuthenticator
from .logs import bound, clip
from .loop import EngineLoop
from .service import ServerState, VLoRAService
from .wire import Limits

PROTOCOL_CONFIG = {
    "allow_public_attrs": False,
    "allow_all_attrs": False,
    "allow_setattr": False,
    "allow_delattr": False,
    "allow_pickle": False,
    "allow_exposed_attrs": True,
    "exposed_prefix": "exposed_",
    "import_custom_exceptions": False,
    "instantiate_custom_exceptions": False,
    "instantiate_oldstyle_exceptions": False,
    "include_local_traceback": False,
    "include_local_version": False,
    "propagate_SystemExit_locally": False,
    "sync_request_timeout": 120,
}


def _quiet_logger() -> logging.Logger:
    """RPyC logs every connect and goodbye at INFO; keep warnings and errors only."""
    logger = logging.getLogger("vlora.serve.rpc.server")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)
    return logger


def _bounded_logs(server_logger: logging.Logger) -> None:
    bound(logging.getLogger("vlora.serve.rpc"), server_logger)


ACCEPT_PAUSE_S = 0.05  # after a failed accept (e.g. EMFILE: out of descriptors) before the next one
MESSAGE_SLACK = 1 << 20  # beyond the frames' bytes: the JSON spec and RPyC's own framing


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


class GuardedServer(ThreadedServer):
    """RPyC's threaded server, hardened at its two unauthenticated doors.

    - RPyC ends its accept loop on any accept() error other than EINTR/EAGAIN, as if closed: a
      flood of sockets that exhausts the process's file descriptors would stop the server with
      exit status 0. Here such errors are logged (at most once a second) and accepting resumes
      after a short pause; only close() ends the loop.
    - Each accepted socket gets a thread for its handshake before any token is seen; at most
      `max_handshakes` run at once, and a socket past that is closed at once, so unauthenticated
      sockets cannot pile up threads (authenticated ones are bounded by max_connections).
    """

    def __init__(self, *args, max_handshakes: int = 64, max_message_bytes: int = 64 << 20, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_message_bytes = max_message_bytes
        self._token_check, self.authenticator = self.authenticator, self._authenticate
        self._handshakes = threading.BoundedSemaphore(max_handshakes)
        self._last_warning = 0.0
        self.accept_errors = 0
        self.handshakes_refused = 0

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 1.0:  # a flood must not flood the log too
            self._last_warning = now
            self.logger.warning(message)

    def accept(self):
        try:
            super().accept()
        except EOFError as e:  # RPyC's word for any accept() error; only close() may end the loop
            if not self.active:
                raise
            self.accept_errors += 1
            cause = e.__context__
            self._warn(f"accept failed ({type(cause).__name__}: {cause}); pausing {ACCEPT_PAUSE_S * 1e3:.0f} ms")
            time.sleep(ACCEPT_PAUSE_S)

    def _accept_method(self, sock):
        if not self._handshakes.acquire(blocking=False):
            self.handshakes_refused += 1
            self._warn("too many connections in their handshake; closing new ones until some finish")
            self.clients.discard(sock)
            try:
                sock.close()
            except OSError:
                pass
            return
        super()._accept_method(sock)

    def _serve_client(self, sock, credentials):
        # RPyC's own, with the bounded channel
        config = dict(self.protocol_config, credentials=credentials,
                      endpoints=(sock.getsockname(), sock.getpeername()), logger=self.logger)
        channel = BoundedChannel(SocketStream(sock), self.max_message_bytes,
                                 lambda why: self._warn(f"connection closed: {why}"))
        try:
            conn = self.service._connect(channel, config)
            self._handle_connection(conn)
        except Exception as e:  # a client's malformed protocol: one clipped line, no traceback per message
            self._warn(f"connection ended: {clip(f'{type(e).__name__}: {e}')}")

    def _authenticate(self, sock: socket.socket):
        """The token check on the connection's thread; its handshake slot is freed however it ends."""
        try:
            return self._token_check(sock)
        except (OSError, ValueError) as e:
            raise AuthenticationError(f"bad handshake: {e}") from None
        finally:
            self._handshakes.release()


class RpcServer:
    def __init__(self, engine, token: str, host: str = "127.0.0.1", port: int = 0, limits: Limits | None = None,
                 max_connections: int = 64, logger: logging.Logger | None = None):
        limits = limits or Limits()
        self.loop = EngineLoop(engine)
        self.state = ServerState(self.loop, limits, max_connections)
        self._server = GuardedServer(classpartial(VLoRAService, self.state), hostname=host, port=port,
                                     authenticator=TokenAuthenticator(token, self.state.admit,
                                                                      limits.handshake_timeout_s),
                                     protocol_config=dict(PROTOCOL_CONFIG), logger=logger or _quiet_logger(),
                                     max_handshakes=limits.max_handshakes or max_connections,
                                     max_message_bytes=limits.max_message_bytes + MESSAGE_SLACK)
        _bounded_logs(self._server.logger)
        self.host, self.port = host, self._server.port
        self._thread: threading.Thread | None = None

    def start(self) -> "RpcServer":
        """Serve from a background thread (tests, the load test); see serve_forever for the command."""
        self.loop.start()
        # listen before returning, so a client may connect at once (start() skips an active listener)
        self._server._listen()
        self._thread = threading.Thread(target=self._server.start, name="vlora-rpc", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self, ready=None) -> None:
        """Serve on this thread until close(); `ready()` is called once connections are accepted."""
        self.loop.start()
        self._server._listen()
        if ready is not None:
            ready()
        try:
            self._server.start()  # returns after close()
        finally:
            self.loop.stop()

    def close(self) -> None:
        self._server.close()
        self.loop.stop()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> "RpcServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
