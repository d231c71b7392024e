"""Validation in both directions: every number a request carries has a floor and a ceiling that keep
the engine working, text is valid Unicode, no reply exceeds its bound whatever was sent, and a real
server refuses a scan bomb while it serves a real request (the frames' own bounds: test_frame_bounds)."""

from __future__ import annotations

import json
import socket
import time

import pytest
from frame_cases import jpeg, picture, scan_bomb

from serve.rpc import Limits, RequestError, parse_submission
from serve.rpc.replies import MAX_ERROR_CHARS, MAX_REPLY_BYTES, error, reply

NAME = "qwen2_vl_tiny"
TOKEN = "test-token-0123456789"


def _spec(**fields) -> str:
    return json.dumps({"prompt": "Describe.", "frames": [], **fields})


@pytest.mark.parametrize("fields, field, bounds", [
    ({"slo_ms": 5e-324}, "slo_ms", "[1, 3600000]"),  # made the policy's starving threshold 0.0
    ({"slo_ms": 1e12}, "slo_ms", "[1, 3600000]"),
    ({"sampling": {"temperature": 1e-30}}, "sampling.temperature", "[0.01, 100]"),
    ({"sampling": {"temperature": 1e6}}, "sampling.temperature", "[0.01, 100]"),
    ({"sampling": {"top_p": 5e-324}}, "sampling.top_p", "[1e-06, 1]"),  # 0.0 in float32: every token cut
    ({"sampling": {"top_k": 10**12}}, "sampling.top_k", "[0, 1000000]"),
    ({"sampling": {"seed": 2**63}}, "sampling.seed", "[0, 9223372036854775807]"),
    ({"sampling": {"stop_token_ids": [5, 2**31]}}, "sampling.stop_token_ids[1]", "[0, 2147483647]"),
    ({"sampling": {"max_tokens": 0}}, "sampling.max_tokens", "[1, 1024]"),
])
def test_absurd_numbers_are_refused_naming_the_field_and_its_bounds(fields, field, bounds):
    with pytest.raises(RequestError) as refused:
        parse_submission("image", _spec(**fields), (), Limits())
    assert refused.value.kind == "bad_argument"
    assert str(refused.value).startswith(f"{field} must lie in {bounds}, got ")


@pytest.mark.parametrize("text", ['{"prompt": "hi", "frames": [], "slo_ms": NaN}',
                                  '{"prompt": "hi", "frames": [], "slo_ms": 1' + "0" * 5000 + "}",
                                  '{"prompt": "hi", "frames": [], "tag": ' + "[" * 40000 + "]" * 40000 + "}"],
                         ids=["nan", "4301_digits", "deep_nesting"])
def test_numbers_json_cannot_hold_and_absurd_nesting_are_refused_as_bad_input(text):
    # NaN, an integer past Python's 4,300 digits (a plain ValueError) and deep nesting (RecursionError)
    # used to escape as internal errors
    with pytest.raises(RequestError) as refused:
        parse_submission("image", text, (), Limits())
    assert refused.value.kind == "bad_argument"


@pytest.mark.parametrize("field", ["prompt", "task", "app", "tag"])
def test_a_lone_surrogate_is_refused_with_its_field_and_position(field):
    text = "ab\ud800cd"
    spec = json.loads(_spec())
    spec[field] = text
    with pytest.raises(RequestError, match=rf"^{field} is not valid Unicode text: a lone surrogate U\+D800 at "
                                           "character 2$"):
        parse_submission("image", json.dumps(spec), (), Limits())


# ---- replies --------------------------------------------------------------------------------------
def test_no_reply_exceeds_its_bound_whatever_it_carries():
    huge = "x" * (10 << 20)
    assert len(error("bad_argument", huge)) < MAX_ERROR_CHARS + 200
    assert len(error("bad_argument", "\U0001F697" * (1 << 20))) < 12 * MAX_ERROR_CHARS + 200  # escaped, still bounded
    events = [{"type": "tokens", "text": "y" * 1000}] * 10_000  # 10 MB of events
    cut = reply(events=events)
    assert len(cut) <= MAX_REPLY_BYTES
    out = json.loads(cut)
    assert out["ok"] and out["truncated"] == {"events": 10_000 - len(out["events"])} and out["events"]
    too_big = json.loads(reply(text=huge))
    assert not too_big["ok"] and too_big["error"]["type"] == "too_large"
    assert json.loads(reply(events=events[:3])) == {"ok": True, "events": events[:3]}  # within: as it was


@pytest.fixture(scope="module")
def rpc(tiny_zoo):
    from serve.engine import Engine, EngineConfig
    from serve.rpc import RpcServer

    engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=64))
    with RpcServer(engine, TOKEN, "127.0.0.1", 0) as server:
        yield server


def test_an_error_reply_never_carries_the_argument_back(rpc):
    # metrics(fmt=s) and poll(request_id=s) quoted s whole: 10 MB in, 10 MB out, per call
    import rpyc
    from rpyc.core.stream import SocketStream

    from serve.rpc import PROTOCOL_CONFIG
    from serve.rpc.auth import client_handshake

    sock = socket.create_connection(("127.0.0.1", rpc.port), timeout=30)
    client_handshake(sock, TOKEN)
    conn = rpyc.connect_stream(SocketStream(sock), config=dict(PROTOCOL_CONFIG, sync_request_timeout=60))
    huge = "x" * (10 << 20)
    try:
        replies = [conn.root.metrics(huge), conn.root.poll(huge, 0.0), conn.root.abort(huge)]
    finally:
        conn.close()
    for text in replies:
        out = json.loads(text)
        assert not out["ok"] and len(text) < MAX_ERROR_CHARS + 200, text[:300]


def test_the_server_refuses_a_scan_bomb_and_a_lone_surrogate_and_serves_a_real_chunk(rpc):
    from serve.rpc import Client, ServerError

    bomb = scan_bomb(jpeg(picture(2160, 3840), progressive=True), 100_000)
    spec = _spec(frames=[{"format": "encoded"}])
    with Client("127.0.0.1", rpc.port, TOKEN) as attacker, Client("127.0.0.1", rpc.port, TOKEN) as client:
        real = client.submit_image("Describe.", [picture(32, 32)], sampling={"max_tokens": 2, "ignore_eos": True},
                                   encoding="jpeg")
        start = time.perf_counter()
        for _ in range(8):
            with pytest.raises(ServerError, match="more than 64 scans") as refused:
                attacker._call("submit_image", spec, (bomb,))
            assert refused.value.kind == "too_large"
        assert (time.perf_counter() - start) / 8 < 0.5
        with pytest.raises(ServerError, match="prompt is not valid Unicode text: a lone surrogate U\\+D800 at "
                                              "character 5") as surrogate:
            attacker.submit_image("hello\ud800", [picture(32, 32)]).result(30)
        assert surrogate.value.kind == "bad_argument"
        assert real.result(60)["finish_reason"] == "length"
        assert json.loads(json.dumps(client._call("metrics")))["pixels_in_flight"] == 0  # everything given back



# ---- what passes the door runs ----------------------------------------------------------------------
EXTREMES = [{"temperature": 0.01}, {"temperature": 100.0}, {"temperature": 100.0, "top_p": 1e-6},
            {"temperature": 0.01, "top_p": 1e-6, "top_k": 1_000_000}, {"temperature": 1.0, "top_k": 1},
            {"temperature": 1.0, "seed": 2**63 - 1}, {"temperature": 1.0, "seed": 0},
            {"stop_token_ids": [0, 2**31 - 1] * 32}, {"max_tokens": 1}]


def test_every_value_at_the_doors_bounds_runs_in_a_real_engine(tiny_zoo):
    # the orchestrator's policy reads slo_ms (its starving threshold), the sampler every sampling value:
    # requests at each floor and ceiling, built from what the door returns, all finish, and the ones
    # whose top_p or top_k keeps only the likeliest token give the greedy tokens (no NaN drawn)
    from serve.engine import Engine, EngineConfig, Request, SamplingParams

    engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=64, policy="v_lora",
                                                 policy_params={}))
    frame = picture(32, 32)
    spec = {"format": "raw", "shape": [32, 32, 3], "dtype": "uint8"}
    requests = []
    for i, (sampling, slo) in enumerate([({"max_tokens": 4}, None)] + [
            ({"max_tokens": 4, **s}, (1, 3_600_000)[i % 2]) for i, s in enumerate(EXTREMES)]):
        sub = parse_submission("image", _spec(frames=[spec], sampling=sampling, slo_ms=slo), (frame.tobytes(),),
                               Limits())
        requests.append(Request(prompt=sub.prompt, images=sub.frames, sampling=SamplingParams(**sub.sampling),
                                slo_ms=sub.slo_ms, request_id=f"r{i}"))
    outputs = {o.request_id: o for o in engine.generate(requests)}
    assert len(outputs) == len(requests)
    for out in outputs.values():
        assert out.finish_reason in ("length", "stop") and out.token_ids, out
    greedy = outputs["r0"].token_ids
    for i, sampling in enumerate(EXTREMES, start=1):
        if sampling.get("top_p") == 1e-6 or sampling.get("top_k") == 1:
            assert outputs[f"r{i}"].token_ids == greedy, sampling
