"""Unload works whenever nothing of the adapter runs, through a real `vlora serve` (its V-LoRA policy).

After a request on adapter X finished the policy kept X merged into the weights while idle:
`list_adapters` said `running: 1` with nothing in flight and `unload_adapter` failed with an internal
error ("held by 1 running sequence(s)"), however long one waited."""

from __future__ import annotations

import numpy as np
import pytest
from rpc_server import TOKEN, ServerProcess

from serve.rpc import Client, ServerError

NAME = "qwen2_vl_tiny"


@pytest.fixture(scope="module")
def adapter_root(tiny_zoo, tmp_path_factory):
    from adapter_cases import build_adapters

    root = tmp_path_factory.mktemp("adapter_root")
    build_adapters(tiny_zoo[NAME], root, ("qv8",))
    return root


def test_an_adapter_left_merged_unloads_at_once(tiny_zoo, vlora_home, adapter_root):
    server = ServerProcess(tiny_zoo[NAME], vlora_home, f"rpc.adapter_root={adapter_root}")
    frame = np.zeros((32, 32, 3), np.uint8)
    try:
        with Client("127.0.0.1", server.port, TOKEN) as client:
            client.load_adapter("x", "qv8")
            busy = client.submit_image("Describe.", [frame], adapter="x", sampling={"max_tokens": 400, "ignore_eos": True})
            next(e for e in busy if e["type"] == "tokens")  # running now
            with pytest.raises(ServerError) as refused:  # in flight: the caller's to wait for, not an internal error
                client.unload_adapter("x")
            assert refused.value.kind == "rejected" and "in flight" in refused.value.message
            busy.abort()
            out = client.submit_image("Describe.", [frame], adapter="x",
                                      sampling={"max_tokens": 16, "ignore_eos": True}).result(60)
            assert len(out["token_ids"]) == 16
            engine = client.metrics()["engine"]
            assert engine["policy"] == "v_lora" and engine["mode"] in ("merge(x)", "mixture(x)"), \
                f"the policy keeps x merged while idle ({engine['mode']})"
            listed = {a["name"]: a for a in client.list_adapters()}
            assert listed["x"]["running"] == 0
            client.unload_adapter("x")  # at once: nothing of it runs
            assert "x" not in {a["name"] for a in client.list_adapters()}
            assert client.metrics()["engine"]["mode"] == "unmerge"
            # the server serves on, and the same directory loads again under the same name
            client.load_adapter("x", "qv8")
            again = client.submit_image("Describe.", [frame], adapter="x", sampling={"max_tokens": 4}).result(60)
            assert again["finish_reason"] in ("length", "stop")
            client.unload_adapter("x")
    finally:
        server.stop()
