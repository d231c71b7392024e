"""The RPyC server in a subprocess and the real client: same outputs as the in-process engine,
concurrency, ordered streams, authentication, the restricted protocol, and bad input."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import rpyc
from rpc_server import TOKEN, ServerProcess
from rpyc.core.stream import SocketStream

from serve import Engine, EngineConfig, Request, SamplingParams
from serve.rpc import AuthError, Client, ServerError
from serve.rpc.auth import client_handshake

NAME = "qwen2_vl_tiny"


def _image(seed: int, h: int = 64, w: int = 80) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _clip(seed: int, n: int = 4, side: int = 56) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, side, side, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def server(tiny_zoo, vlora_home):
    proc = ServerProcess(tiny_zoo[NAME], vlora_home, "rpc.max_queued_per_connection=4")
    yield proc
    proc.stop()


@pytest.fixture
def client(server):
    with Client("127.0.0.1", server.port, TOKEN) as c:
        yield c


def _raw(client: Client):
    """The client's underlying RPyC connection, to send what the library would never send."""
    return client._conn


def _quiet(client: Client, deadline_s: float = 20.0) -> dict:
    """Health once nothing is in flight (aborts are asynchronous)."""
    end = time.monotonic() + deadline_s
    while True:
        health = client.health()
        if (health["in_flight"] == 0 and health["blocks_in_use"] == 0) or time.monotonic() > end:
            return health
        time.sleep(0.05)


def test_image_and_video_requests_match_the_in_process_engine(server, client, tiny_zoo):
    engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=96))
    cases = [("image", "How many cars?", [_image(0)]), ("image", "Compare the two pictures.", [_image(1), _image(2, 40, 90)]),
             ("video", "Which way do they go?", _clip(3))]
    for kind, prompt, media in cases:
        local = engine.generate(Request(prompt=prompt, images=list(media) if kind == "image" else [],
                                        video=media if kind == "video" else None,
                                        sampling=SamplingParams(max_tokens=6, ignore_eos=True)))
        submit = client.submit_image if kind == "image" else client.submit_video
        for encoding in ("png", "raw"):  # both lossless: the pixels must arrive unchanged
            final = submit(prompt, media, sampling={"max_tokens": 6, "ignore_eos": True}, encoding=encoding).result(60)
            assert final["token_ids"] == local.token_ids, (kind, encoding)
            assert final["text"] == local.text
            timing = final["timing"]
            assert timing["prompt_tokens"] == local.metrics.num_prompt_tokens
            assert all(timing[k] is not None and timing[k] >= 0 for k in ("frame_decode_ms", "queue_ms", "prefill_ms"))
            assert timing["preprocess_ms"] > 0  # the processor ran on the connection's thread, not the engine's


def test_many_concurrent_clients_stream_in_order(server):
    results: dict[int, tuple[list[dict], dict]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with Client("127.0.0.1", server.port, TOKEN) as c:
                streams = [c.submit_image(f"Question {i}-{j}: how many buses?", [_image(10 + i)],
                                          sampling={"max_tokens": 5, "ignore_eos": True}, tag=f"{i}-{j}")
                           for j in range(2)]
                for s in streams:
                    events = list(s)
                    results[len(results)] = (events, s.final)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 12
    for events, final in results.values():
        tokens = [t for e in events if e["type"] == "tokens" for t in e["token_ids"]]
        # tokens events carry the new tokens in order; the final event may carry the last one itself
        assert final["token_ids"][:len(tokens)] == tokens and len(final["token_ids"]) == 5
        assert "".join(e["text"] for e in events if e["type"] == "tokens") + final.get("new_text", "") == final["text"]
        assert all(e["tag"] == events[0]["tag"] for e in events)


def test_a_wrong_token_is_rejected(server):
    with pytest.raises(AuthError, match="refused the token"):
        Client("127.0.0.1", server.port, "not-the-token-at-all")
    with pytest.raises(Exception):  # classic mode: no handshake, the server drops the socket
        conn = rpyc.classic.connect("127.0.0.1", server.port)
        conn.modules.os.getcwd()
    assert server.alive()


def test_restricted_protocol_refuses_attribute_walks_and_undeclared_methods(server, client):
    root = _raw(client).root
    for name in ("state", "_tickets", "conn_id", "_submit", "__dict__", "on_connect", "exposed_"):
        with pytest.raises(AttributeError):
            getattr(root, name)
    with pytest.raises(AttributeError):
        root.exposed_submit_image.__globals__
    with pytest.raises(AttributeError):
        root.shutdown()
    with pytest.raises(Exception):
        _raw(client).modules.os  # classic module access does not exist on this service
    assert client.health()["healthy"]


def _expect(client: Client, kind: str, method: str, *args) -> None:
    reply = json.loads(getattr(_raw(client).root, method)(*args))
    assert not reply["ok"] and reply["error"]["type"] == kind, reply
    assert reply["error"]["message"]


def test_bad_input_is_answered_to_its_client_and_frees_everything(server, client):
    spec = lambda **kw: json.dumps({"prompt": "Count the cars.", "frames": [{"format": "encoded"}], **kw})
    raw = lambda shape, dtype="uint8": json.dumps({"prompt": "hi", "frames": [{"format": "raw", "shape": shape, "dtype": dtype}]})
    _expect(client, "bad_frame", "submit_image", spec(), (b"\x89PNG but not really",))
    _expect(client, "bad_frame", "submit_image", raw([4, 4, 3]), (b"\x00" * 47,))
    _expect(client, "bad_frame", "submit_image", raw([4, 4, 3], "float32"), (b"\x00" * 192,))
    _expect(client, "bad_frame", "submit_image", raw([4, 4]), (b"\x00" * 16,))
    _expect(client, "too_large", "submit_image", raw([5000, 5000, 3]), (b"",))
    _expect(client, "too_large", "submit_image", json.dumps({"prompt": "x" * 9000, "frames": []}), ())
    _expect(client, "too_large", "submit_video", json.dumps({"prompt": "hi", "frames": [{"format": "raw", "shape": [1, 1, 3], "dtype": "uint8"}] * 65}),
            (b"\x00" * 3,) * 65)
    _expect(client, "bad_argument", "submit_image", "{not json", ())
    _expect(client, "bad_argument", "submit_image", json.dumps({"prompt": "hi", "frames": [], "colour": 1}), ())
    _expect(client, "bad_argument", "submit_image", json.dumps({"prompt": "hi", "frames": [], "sampling": {"top_p": 2}}), ())
    _expect(client, "bad_argument", "submit_image", json.dumps({"prompt": "hi", "frames": []}), [])  # a list is a reference
    _expect(client, "bad_argument", "submit_image", 42, ())
    _expect(client, "bad_argument", "submit_image", json.dumps({"prompt": "hi", "frames": []}))  # missing argument
    _expect(client, "unknown_request", "poll", "c0-999", 0.0)
    with pytest.raises(ServerError, match="no adapter 'no-such-adapter'"):  # refused at the door: none by that name
        client.submit_image("Count.", [_image(5)], adapter="no-such-adapter").result(30)
    # over the per-connection limit (4 in flight)
    streams = [client.submit_image("Describe it.", [_image(6)], sampling={"max_tokens": 200, "ignore_eos": True})
               for _ in range(4)]
    with pytest.raises(ServerError, match="too_many_requests"):
        client.submit_image("One more.", [_image(7)])
    for s in streams:
        s.abort()
        assert s.result(30)["finish_reason"] == "abort"
    health = _quiet(client)
    assert health["in_flight"] == 0 and health["blocks_in_use"] == 0
    final = client.submit_image("Still serving?", [_image(8)], sampling={"max_tokens": 3, "ignore_eos": True}).result(30)
    assert len(final["token_ids"]) == 3 and server.alive()


def test_a_client_that_disconnects_mid_stream_is_cleaned_up(server, client):
    other = Client("127.0.0.1", server.port, TOKEN)
    stream = other.submit_video("Tell me a long story.", _clip(9), sampling={"max_tokens": 500, "ignore_eos": True})
    assert stream.poll(5.0) or stream.poll(5.0)  # it is running
    other._conn._channel.stream.sock.close()  # drop the socket without a goodbye
    health = _quiet(client)
    assert health["in_flight"] == 0 and health["blocks_in_use"] == 0
    assert client.metrics()["server"].get("aborted_on_disconnect", 0) >= 1


def test_the_client_reconnects_and_resubmits_after_a_dropped_connection(server):
    with Client("127.0.0.1", server.port, TOKEN) as c:
        stream = c.submit_image("How many trucks?", [_image(11)], sampling={"max_tokens": 40, "ignore_eos": True})
        c._conn._channel.stream.sock.close()
        events = list(stream)
        assert any(e["type"] == "restart" for e in events)
        assert len(stream.final["token_ids"]) == 40 and c.generation == 2


def test_metrics_in_prometheus_text(client):
    # `vlora serve` froze its heap before it listened: no full collection walks start-up's objects again
    assert client.metrics()["server"]["heap_frozen_objects"] > 10_000
    text = client.metrics("prometheus")
    assert "# TYPE vlora_engine_blocks_in_use gauge" in text
    assert "vlora_server_connections " in text
    assert "# TYPE vlora_engine_anticipation_waits counter" in text  # the waits for a returning tenant
    assert "vlora_engine_anticipation_max_ms 20.0" in text
    # the garbage collections' pauses, one series per generation under one TYPE line
    assert text.count("# TYPE vlora_engine_gc_ms counter") == 1
    assert re.search(r'^vlora_engine_gc_count\{generation="0"\} \d+$', text, re.M)
    assert 'vlora_engine_gc_max_ms{generation="2"} ' in text


def test_a_fuzz_run_of_malformed_calls_leaves_the_server_healthy(server, client):
    rng = np.random.default_rng(0)
    good_png = Client._frames(client, [_image(12, 16, 16)], "png")[1][0]
    blobs = [b"", b"\x00" * 7, good_png, good_png[: len(good_png) // 2], bytes(rng.integers(0, 256, 300, dtype=np.uint8)),
             b"\xff\xd8\xff" + b"\x00" * 64]
    frame_specs = [{"format": "encoded"}, {"format": "raw", "shape": [4, 4, 3], "dtype": "uint8"},
                   {"format": "raw", "shape": [-1, 4, 3], "dtype": "uint8"}, {"format": "gif"}, None, "x",
                   {"format": "raw", "shape": [2, 2, 3], "dtype": "int64"}]
    values = [None, 0, -1, 1.5, float("inf"), "", "x" * 300, [], {}, True, "generate", "head"]
    cases = 0
    for _ in range(2000):
        n = int(rng.integers(0, 3))
        spec = {"prompt": rng.choice(["Count.", "", "x" * 9000, None, 7], p=[0.6, 0.1, 0.1, 0.1, 0.1]),
                "frames": [frame_specs[int(rng.integers(len(frame_specs)))] for _ in range(n)]}
        for key in rng.choice(["adapter", "output_mode", "sampling", "app", "slo_ms", "tag", "bogus"],
                              size=int(rng.integers(0, 3)), replace=False):
            spec[str(key)] = values[int(rng.integers(len(values)))]
        if rng.random() < 0.3:
            spec["sampling"] = {"max_tokens": int(rng.integers(-2, 3)), "temperature": float(rng.normal())}
        payload = json.dumps(spec) if rng.random() > 0.05 else "{]"
        method = "submit_image" if rng.random() < 0.5 else "submit_video"
        data = tuple(blobs[int(rng.integers(len(blobs)))] for _ in range(n + int(rng.integers(0, 2))))
        reply = json.loads(getattr(_raw(client).root, method)(payload, data))
        cases += 1
        if reply["ok"]:  # the few that are valid run to the end (or fail in the engine) like any other
            try:
                client._call("abort", reply["request_id"])
            except ServerError:
                pass
    print(f"fuzz: {cases} malformed or random calls")
    health = _quiet(client)
    assert health["healthy"] and health["in_flight"] == 0 and health["blocks_in_use"] == 0
    assert client.submit_image("OK?", [_image(13)], sampling={"max_tokens": 2}).result(30)["finish_reason"] in ("stop", "length")


def test_the_rpc_client_imports_without_torch():
    # applications reach the server only through the client: it must not load the engine
    code = "import sys, serve.rpc.client; from serve.rpc import Client; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "False"
