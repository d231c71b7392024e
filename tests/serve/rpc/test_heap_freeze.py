"""A server's heap frozen before it listens (serve.rpc.memory.freeze_heap): what start-up left alive is
exempt from the collector's full walks, which under camera load stalled every connection thread for
0.3 s; garbage made before it is collected first, and what comes after is still collected."""

from __future__ import annotations

import gc
import weakref

from serve import Engine, EngineConfig
from serve.rpc import Client, RpcServer

TOKEN = "heap-freeze-token"


class _Cycle:
    def __init__(self):
        self.me = self


def test_a_server_freezes_its_heap_before_it_listens_and_collects_what_comes_after(tiny_zoo):
    gc.unfreeze()
    engine = Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(device="cpu", num_kv_blocks=32))
    gc.disable()  # no collection of its own between here and the server's start
    before = _Cycle()
    gone = weakref.ref(before)
    del before  # garbage before the freeze: collected by it, never frozen
    try:
        with RpcServer(engine, TOKEN, freeze=True) as server:
            gc.enable()
            assert server.frozen_objects > 10_000 and gc.get_freeze_count() > server.frozen_objects // 2
            assert gone() is None
            with Client("127.0.0.1", server.port, TOKEN) as client:
                assert client.metrics()["server"]["heap_frozen_objects"] == server.frozen_objects
                after = _Cycle()
                del after
                assert gc.collect() >= 1  # a cycle made while serving is still garbage the collector finds
    finally:
        gc.enable()
        gc.unfreeze()  # this process builds many servers: give their objects back to the collector
    with RpcServer(engine, TOKEN) as server:  # freeze off (the default): the heap is left as it is
        assert server.frozen_objects == 0 and gc.get_freeze_count() == 0
