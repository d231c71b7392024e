"""A server whose engine prepares pixels on its device: JPEG video frames cross the wire and the
server still encoded, answers equal the in-process engine's, and bad JPEG data fails only its own
request (a truncated file at the door, undecodable data at encode time)."""

from __future__ import annotations

import numpy as np
import pytest
from rpc_server import TOKEN, ServerProcess

from serve import Engine, EngineConfig, Request, SamplingParams
from serve.rpc import Client
from serve.rpc.wire import encode_frame

NAME = "qwen2_vl_tiny"


def _clip(seed: int, n: int = 4, side: int = 56) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, side, side, 3), dtype=np.uint8)


def _jpeg(frame: np.ndarray) -> bytes:
    return encode_frame(frame, "jpeg")[1]  # what the client sends


@pytest.fixture(scope="module")
def server(tiny_zoo, vlora_home):
    proc = ServerProcess(tiny_zoo[NAME], vlora_home, "engine.pixels=device")
    yield proc
    proc.stop()


def test_jpeg_video_over_the_wire_matches_the_in_process_engine(server, tiny_zoo):
    engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=96, pixels="device"))
    clip = _clip(3)
    local = engine.generate(Request(prompt="Which way do they go?", video=[_jpeg(f) for f in clip],
                                    sampling=SamplingParams(max_tokens=6, ignore_eos=True)))
    with Client("127.0.0.1", server.port, TOKEN) as client:
        final = client.submit_video("Which way do they go?", clip, sampling={"max_tokens": 6, "ignore_eos": True},
                                    encoding="jpeg").result(60)
    assert final["token_ids"] == local.token_ids


def test_bad_jpeg_data_fails_only_its_request(server):
    import json

    clip = _clip(4)
    good = [_jpeg(f) for f in clip]
    truncated = good[:3] + [good[3][: len(good[3]) // 2]]
    scrambled = bytearray(good[3])
    scrambled[200:-2] = bytes(len(scrambled) - 202)  # header and end marker intact, entropy data zeroed
    spec = json.dumps({"prompt": "Count the cars.", "frames": [{"format": "encoded"}] * 4,
                       "sampling": {"max_tokens": 3, "ignore_eos": True}})
    with Client("127.0.0.1", server.port, TOKEN) as client:
        reply = json.loads(client._conn.root.submit_video(spec, tuple(truncated)))
        assert not reply["ok"] and reply["error"]["type"] == "bad_frame" and "truncated" in reply["error"]["message"]
        bystander = client.submit_video("Any cars?", _clip(5), sampling={"max_tokens": 3, "ignore_eos": True},
                                        encoding="jpeg")
        # a well-formed header and end marker around zeroed data passes the door; the engine's decode
        # of it must not cost the bystander or the server anything
        client._conn.root.submit_video(spec, tuple(good[:3] + [bytes(scrambled)]))
        assert len(bystander.result(60)["token_ids"]) == 3
        again = client.submit_video("Still serving?", clip, sampling={"max_tokens": 3, "ignore_eos": True},
                                    encoding="jpeg").result(60)
        assert len(again["token_ids"]) == 3 and server.alive()
