"""The client library.

    with Client("127.0.0.1", 18861, token) as client:
        stream = client.submit_image("How many cars?", [frame])            # returns at once
        for event in stream: print(event["type"], event.get("text"))       # tokens ..., final
        result = client.submit_video("Which way do they go?", frames).result()

Submissions do not block: many streams can be open at once (`Client.gather`). Events of one
stream arrive in order. Server-side errors raise `ServerError` with the server's reason. When
the connection drops, the client reconnects and resubmits the streams that were in flight
(the server aborted them when the connection closed); such a stream yields a `restart` event
and starts its text over.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Iterator

import numpy as np
import rpyc
from rpyc.core.stream import SocketStream

from .auth import client_handshake
from .wire import encode_frame

CLIENT_CONFIG = {"allow_public_attrs": False, "allow_all_attrs": False, "allow_pickle": False,
                 "import_custom_exceptions": False, "instantiate_custom_exceptions": False,
                 "sync_request_timeout": 120}
_DROPPED = (EOFError, ConnectionError, OSError)


class ServerError(RuntimeError):
    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


class Stream:
    """One request's events. Iterate for `tokens` events and the `final` one, or call result()."""

    def __init__(self, client: "Client", method: str, spec: dict[str, Any], blobs: tuple[bytes, ...]):
        self.client, self.method, self.spec, self.blobs = client, method, spec, blobs
        self.request_id = ""
        self.final: dict[str, Any] | None = None
        self._pending: list[dict[str, Any]] = []
        self.submit()

    def submit(self) -> None:
        self.request_id = self.client._call(self.method, json.dumps(self.spec), self.blobs, retry=True)["request_id"]

    def poll(self, timeout_s: float = 0.5) -> list[dict[str, Any]]:
        """Events that arrived since the last poll (waits up to timeout_s for the first)."""
        if self.final is not None:
            return []
        generation = self.client.generation
        try:
            events = self.client._call("poll", self.request_id, timeout_s)["events"]
        except ServerError as e:
            if e.kind == "unknown_request" and self.client.generation != generation:
                self.submit()  # the connection dropped and the server aborted us: start over
                return [{"type": "restart", "request_id": self.request_id}]
            raise
        for event in events:
            if event["type"] == "error":
                self.final = event
                raise ServerError(event["error"]["type"], event["error"]["message"])
            if event["type"] == "final":
                self.final = event
        return events

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.final is None:
            yield from self.poll()

    def result(self, timeout_s: float | None = None) -> dict[str, Any]:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.final is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout_s} s")
            self.poll()
        return self.final

    def abort(self) -> None:
        if self.final is None:
            self.client._call("abort", self.request_id)


class Client:
    def __init__(self, host: str, port: int, token: str, timeout_s: float = 30.0, reconnect: bool = True,
                 encoding: str = "png", source: str | None = None):
        """source: the local address to connect from (a host with several), None for the system's choice."""
        self.host, self.port, self._token, self.source = host, port, token, source
        self.timeout_s, self.reconnect, self.encoding = timeout_s, reconnect, encoding
        self._lock = threading.RLock()  # one call on the connection at a time
        self._conn = None
        self.generation = 0  # bumps at every (re)connection
        self.connect()

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s,
                                        source_address=None if self.source is None else (self.source, 0))
        try:
            client_handshake(sock, self._token, self.timeout_s)
            self._conn = rpyc.connect_stream(SocketStream(sock), config=dict(CLIENT_CONFIG))
        except BaseException:
            sock.close()
            raise
        self.generation += 1

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                conn, self._conn = self._conn, None
                try:
                    conn.close()
                except (EOFError, OSError, AttributeError):
                    # the server cut the connection first (a revoked token, say): rpyc's own teardown may
                    # have run already and closing again raises (AttributeError on its dropped root)
                    pass

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, *args, retry: bool = True) -> dict[str, Any]:
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._conn is None:
                        self.connect()
                    reply = json.loads(getattr(self._conn.root, method)(*args))
                    break
                except _DROPPED:
                    self._conn = None
                    if attempt or not (retry and self.reconnect):
                        raise
        if not reply["ok"]:
            raise ServerError(reply["error"]["type"], reply["error"]["message"])
        return reply

    def _frames(self, frames, encoding: str | None) -> tuple[list[dict], tuple[bytes, ...]]:
        pairs = [encode_frame(np.asarray(f), encoding or self.encoding) for f in frames]
        return [s for s, _ in pairs], tuple(b for _, b in pairs)

    def _spec(self, prompt, specs, adapter, output_mode, sampling, app, slo_ms, tag, task=None) -> dict[str, Any]:
        return {"prompt": prompt, "frames": specs, "adapter": adapter, "task": task, "output_mode": output_mode,
                "sampling": sampling or {}, "app": app, "slo_ms": slo_ms, "tag": tag}

    def submit_image(self, prompt: str, images, adapter: str | None = None, output_mode: str = "generate",
                     sampling: dict | None = None, app: str | None = None, slo_ms: float | None = None,
                     tag: str | None = None, encoding: str | None = None, task: str | None = None) -> Stream:
        """images: RGB uint8 [H, W, 3] arrays (or one array). task: which head of the adapter answers."""
        images = [images] if isinstance(images, np.ndarray) and images.ndim == 3 else images
        specs, blobs = self._frames(images, encoding)
        return Stream(self, "submit_image", self._spec(prompt, specs, adapter, output_mode, sampling, app, slo_ms, tag, task),
                      blobs)

    def submit_video(self, prompt: str, frames, adapter: str | None = None, output_mode: str = "generate",
                     sampling: dict | None = None, app: str | None = None, slo_ms: float | None = None,
                     tag: str | None = None, encoding: str | None = None, task: str | None = None) -> Stream:
        """frames: a video chunk, uint8 [T, H, W, 3] or a list of [H, W, 3] frames. task: which head of the adapter answers."""
        specs, blobs = self._frames(list(frames), encoding)
        return Stream(self, "submit_video", self._spec(prompt, specs, adapter, output_mode, sampling, app, slo_ms, tag, task),
                      blobs)

    @staticmethod
    def gather(streams: list[Stream], timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Final events of several streams, polled round-robin so none waits on another."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(s.final is None for s in streams):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{sum(s.final is None for s in streams)} streams did not finish in time")
            for s in streams:
                s.poll(0.05)
        return [s.final for s in streams]

    def list_adapters(self) -> list:
        return self._call("list_adapters")["adapters"]

    def health(self) -> dict[str, Any]:
        return self._call("health")

    def wait_ready(self, timeout_s: float = 600.0, on_wait=None) -> dict[str, Any]:
        """Waits while the server warms its engine up (health state "warming"); returns the health
        reply once it takes work. on_wait(reply) is called once, on the first warming reply."""
        deadline = time.monotonic() + timeout_s
        told = False
        while True:
            health = self.health()
            if health.get("state") != "warming":
                return health
            if not told and on_wait is not None:
                on_wait(health)
                told = True
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was still warming up after {timeout_s:g} s")
            time.sleep(0.5)

    def metrics(self, fmt: str = "json"):
        reply = self._call("metrics", fmt)
        return reply["text"] if fmt == "prometheus" else reply

    def load_adapter(self, name: str, path: str) -> None:
        self._call("load_adapter", name, path)

    def unload_adapter(self, name: str) -> None:
        self._call("unload_adapter", name)
