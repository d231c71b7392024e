"""Application priorities over RPC: set by the operator per application name, carried into the
engine's requests (what the orchestrator's policy reads), never raised by a client."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rpc_server import TOKEN

from serve import Request
from serve.engine import Engine, EngineConfig
from serve.rpc import Client, Limits, RpcServer

NAME = "qwen2_vl_tiny"


def test_priorities_are_validated_where_they_are_set():
    assert Limits.from_dict({"app_priorities": {"video_analytics": 2}}).priority("video_analytics") == 2.0
    assert Limits().priority("video_analytics") == 1.0 and Limits().priority(None) == 1.0
    for bad in (0, -1.0, float("inf"), True, "high"):
        with pytest.raises(ValueError, match="app_priorities"):
            Limits(app_priorities={"a": bad})
        with pytest.raises(ValueError, match="priority must be"):
            Request(prompt="hi", priority=bad)


def test_a_request_gets_its_applications_priority_and_a_client_cannot_ask_for_one(tiny_zoo):
    engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=64))
    limits = Limits(app_priorities={"video_analytics": 2.0})
    image = np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)
    with RpcServer(engine, TOKEN, "127.0.0.1", 0, limits) as rpc, Client("127.0.0.1", rpc.port, TOKEN) as client:
        long = {"max_tokens": 400, "ignore_eos": True}
        streams = {app: client.submit_image("Describe it.", [image], sampling=long, app=app)
                   for app in ("video_analytics", "visual_retrieval", None)}
        seen = rpc.loop.call(lambda e: {t.request.app: t.request.priority for t in e._requests.values()})
        assert seen == {"video_analytics": 2.0, "visual_retrieval": 1.0, None: 1.0}
        assert [rpc.loop.call(lambda e, s=s: e._request_info(s.request_id)[2]) for s in streams.values()] == \
            [2.0, 1.0, 1.0]  # what the planner hands the policy
        for s in streams.values():
            s.abort()
        spec = json.dumps({"prompt": "hi", "frames": [], "priority": 100})
        reply = json.loads(client._conn.root.submit_image(spec, ()))
        assert not reply["ok"] and reply["error"]["type"] == "bad_argument" and "priority" in reply["error"]["message"]
