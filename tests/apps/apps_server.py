"""Helpers of the application tests: a real RPyC server over a tiny-zoo engine, in-process, and
small synthetic-world media (64x64 frames, 10-frame clips at 10 fps) so every request is quick."""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
import time

from serve.engine import Engine, EngineConfig
from serve.rpc import Client, Limits, RpcServer

TOKEN = "apps-test-token-0123456789"
MODEL = "qwen2_vl_tiny"
WORLD = {"width": 64, "height": 64, "fps": 10, "clip_frames": 10}


@contextlib.contextmanager
def serving(checkpoint, adapter_root: str = "", **limits):
    """adapter_root: where clients may load adapters from at run time ("" = nowhere); limits: other
    fields of serve.rpc.Limits (max_frame_pixels, ...)."""
    engine = Engine(checkpoint, EngineConfig(device="cpu", num_kv_blocks=512))
    server = RpcServer(engine, TOKEN, "127.0.0.1", 0, Limits(adapter_root=adapter_root, **limits)).start()
    try:
        yield server
    finally:
        server.close()


def connector(server):
    return lambda: Client("127.0.0.1", server.port, TOKEN)


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def http_server(directory):
    """A plain HTTP file server on loopback (a camera's HTTP stream, as OpenCV reads it)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
