"""`vlora serve` steps a CPU engine on the usable cores less one (rpc.engine_threads=auto) in the engine's own
process, or on an operator's number on a thread of the server's. Read back from a real server's metrics."""

from __future__ import annotations

import pytest
from rpc_server import TOKEN, ServerProcess

from serve.rpc import Client
from serve.rpc.tenant_processes import usable_cores

NAME = "qwen2_vl_tiny"


@pytest.mark.parametrize("overrides, want", [
    ((), max(1, usable_cores() - 1)),
    (("rpc.engine_process=false", "rpc.engine_threads=3"), 3),
])
def test_the_engine_steps_on_the_threads_it_was_given(tiny_zoo, tmp_path, monkeypatch, overrides, want):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # torch's default would be every core
    server = ServerProcess(tiny_zoo[NAME], tmp_path, *overrides)
    try:
        with Client("127.0.0.1", server.port, TOKEN) as client:
            assert client.metrics()["engine"]["cpu_threads"] == want
    finally:
        server.stop()
