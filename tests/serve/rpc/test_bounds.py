"""Validation in both directions and bounded work per request: every number a request carries has a
floor and a ceiling that keep the engine working, text is valid Unicode, no reply exceeds its bound
whatever was sent, and an encoded frame's decoding cost (time and memory) is known and bounded before
any pixel is decoded."""

from __future__ import annotations

import io
import json
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from serve.rpc import Limits, RequestError, parse_submission
from serve.rpc.frames import open_frame, peak_pixels
from serve.rpc.replies import MAX_ERROR_CHARS, MAX_REPLY_BYTES, error, reply

NAME = "qwen2_vl_tiny"
TOKEN = "test-token-0123456789"
ROOT = Path(__file__).resolve().parents[3]


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
                                  '{"prompt": "hi", "frames": [], "tag": ' + "[" * 40000 + "]" * 40000 + "}"])
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
    import socket

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


# ---- frames -------------------------------------------------------------------------------------
def _jpeg(img: np.ndarray, **options) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90, **options)
    return buf.getvalue()


def _picture(height: int, width: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // width, y * 255 // height, (x * y) % 251], -1).astype(np.uint8)


def _scan_bomb(progressive: bytes, scans: int) -> bytes:
    """`progressive` with `scans` empty copies of its last scan's header before its end-of-image marker:
    each costs the decoder a pass over the whole image (100,000 at 4K: ~43 s), for 10 bytes."""
    at = [m.start() for m in re.finditer(rb"\xff\xda", progressive)][-1]
    header = progressive[at:at + 2 + struct.unpack_from(">H", progressive, at + 2)[0]]
    end = progressive.rindex(b"\xff\xd9")
    return progressive[:end] + header * scans + progressive[end:]


@pytest.fixture(scope="module")
def progressive_4k() -> bytes:
    return _jpeg(_picture(2160, 3840), progressive=True)


def test_a_scan_bomb_is_refused_in_milliseconds(progressive_4k):
    bomb = _scan_bomb(progressive_4k, 100_000)
    start = time.perf_counter()
    with pytest.raises(RequestError, match=r"frame 0: the JPEG stream has more than 64 scans \(rpc.max_jpeg_scans") \
            as refused:
        open_frame(bomb, {"format": "encoded"}, Limits(), 0)
    assert time.perf_counter() - start < 0.5 and refused.value.kind == "too_large"


def test_real_jpegs_still_decode_as_before(progressive_4k):
    import cv2

    small = _picture(96, 128)
    ok, opencv = cv2.imencode(".jpg", small[:, :, ::-1])
    for blob in (progressive_4k, _jpeg(small, progressive=True, subsampling=0), opencv.tobytes(), _jpeg(small)):
        frame = open_frame(blob, {"format": "encoded"}, Limits(), 0).decode()
        with Image.open(io.BytesIO(blob)) as img:
            assert np.array_equal(frame, np.asarray(img.convert("RGB")))
        assert frame.flags.writeable and frame.flags.c_contiguous


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "CMYK", "I;16", "LA"])
def test_every_mode_decodes_to_the_same_rgb_as_a_whole_image_convert(mode):
    img = Image.fromarray(_picture(70, 90))
    img = img.quantize(64) if mode == "P" else img.convert("I;16") if mode == "I;16" else img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="JPEG" if mode == "CMYK" else "PNG")
    frame = open_frame(buf.getvalue(), {"format": "encoded"}, Limits(), 0).decode()
    with Image.open(io.BytesIO(buf.getvalue())) as again:
        assert np.array_equal(frame, np.asarray(again.convert("RGB")))


@pytest.mark.parametrize("blob, message", [
    (lambda jpg, png: jpg + b"payload", "bytes follow the JPEG end-of-image marker"),
    (lambda jpg, png: jpg[:-2], "truncated"),
    (lambda jpg, png: jpg[:2] + jpg[2:].replace(b"\xff\xc0", b"\xff\xc3", 1), "frame type 0xFFC3"),
    (lambda jpg, png: png + b"x", "bytes follow the PNG IEND marker"),
    (lambda jpg, png: png[:33] + _png_chunk(b"IDAT", b"") + _png_chunk(b"tEXt", b"a\x00b") + png[33:],
     "image data (IDAT) is split"),
    (lambda jpg, png: png[:33] + _png_chunk(b"tEXt", b"a\x00b") * 70_000 + png[33:], "more than 65536 chunks"),
])
def test_marker_abuse_is_refused_before_decoding(blob, message):
    img = _picture(16, 16)
    png = io.BytesIO()
    Image.fromarray(img).save(png, format="PNG")
    data = blob(_jpeg(img), png.getvalue())
    start = time.perf_counter()
    with pytest.raises(RequestError, match=re.escape(message)):
        open_frame(data, {"format": "encoded"}, Limits(), 0)
    assert time.perf_counter() - start < 0.5


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    import zlib

    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def test_a_decode_past_its_cpu_time_is_stopped(progressive_4k):
    opened = open_frame(progressive_4k, {"format": "encoded"}, Limits(max_decode_cpu_s=0.002), 0)
    with pytest.raises(RequestError, match=r"decoding took more than 0.002 s of CPU time") as stopped:
        opened.decode()
    assert stopped.value.kind == "too_large"


def test_the_server_refuses_a_scan_bomb_and_a_lone_surrogate_and_serves_a_real_chunk(rpc, progressive_4k):
    from serve.rpc import Client, ServerError

    bomb = _scan_bomb(progressive_4k, 100_000)
    spec = _spec(frames=[{"format": "encoded"}])
    with Client("127.0.0.1", rpc.port, TOKEN) as attacker, Client("127.0.0.1", rpc.port, TOKEN) as client:
        real = client.submit_image("Describe.", [_picture(32, 32)], sampling={"max_tokens": 2, "ignore_eos": True},
                                   encoding="jpeg")
        start = time.perf_counter()
        for _ in range(8):
            with pytest.raises(ServerError, match="more than 64 scans") as refused:
                attacker._call("submit_image", spec, (bomb,))
            assert refused.value.kind == "too_large"
        assert (time.perf_counter() - start) / 8 < 0.5
        with pytest.raises(ServerError, match="prompt is not valid Unicode text: a lone surrogate U\\+D800 at "
                                              "character 5") as surrogate:
            attacker.submit_image("hello\ud800", [_picture(32, 32)]).result(30)
        assert surrogate.value.kind == "bad_argument"
        assert real.result(60)["finish_reason"] == "length"
        assert json.loads(json.dumps(client._call("metrics")))["pixels_in_flight"] == 0  # everything given back


# ---- the pixel budget ---------------------------------------------------------------------------
def test_the_budget_is_charged_the_decoders_peak_of_the_largest_frame():
    import cv2

    small, big = _picture(32, 32), _picture(64, 64)
    blobs = tuple(cv2.imencode(".png", f[:, :, ::-1])[1].tobytes() for f in (small, big))
    taken = []
    sub = parse_submission("image", _spec(frames=[{"format": "encoded"}] * 2), blobs, Limits(),
                           reserve=lambda n: taken.append(n) or (lambda: None))
    assert [f.shape for f in sub.frames] == [(32, 32, 3), (64, 64, 3)]
    # both frames held, and the larger one's decoder transient on top (they decode one at a time)
    assert taken == [32 * 32 + peak_pixels(64 * 64)] and peak_pixels(64 * 64) == 64 * 64 * 5 // 2  # 7.5 B of 3
    raw = parse_submission("image", _spec(frames=[{"format": "raw", "shape": [64, 64, 3], "dtype": "uint8"}]),
                           (big.tobytes(),), Limits(), reserve=lambda n: taken.append(n) or (lambda: None))
    assert taken[-1] == 64 * 64 and raw.frames[0].flags.writeable  # a raw frame is one copy: itself
    # a progressive 4:4:4 JPEG also holds 3 DCT coefficients a pixel, 2 bytes each, beside Pillow's image
    progressive = open_frame(_jpeg(big, progressive=True, subsampling=0), {"format": "encoded"}, Limits(), 0)
    assert progressive.peak_pixels == int(np.ceil(64 * 64 * 10.5 / 3))


MEASURE = """
import sys
from serve.rpc import Limits
from serve.rpc.frames import open_frame
blob = open(sys.argv[1], "rb").read()
open_frame(blob[:0] + open(sys.argv[2], "rb").read(), {"format": "encoded"}, Limits(), 0).decode()  # warm
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
opened = open_frame(blob, {"format": "encoded"}, Limits(), 0)
open("/proc/self/clear_refs", "w").write("5")  # VmHWM back to the present RSS
base = status("VmRSS:")
frame = opened.decode()
print(status("VmHWM:") - base, opened.peak_pixels * 3)
"""


def test_the_charge_bounds_the_real_peak_of_decoding_a_4k_frame(tmp_path, progressive_4k):
    # in a fresh process (tracemalloc does not see Pillow's allocations): the resident high-water mark
    # rises by no more than the bytes charged; the earlier path peaked at 14 bytes a pixel, charged 3
    import cv2

    ok, png = cv2.imencode(".png", _picture(2160, 3840))
    small = tmp_path / "small.png"
    Image.fromarray(_picture(64, 64)).save(small)
    for name, blob in (("png", png.tobytes()), ("progressive", progressive_4k),
                       ("progressive444", _jpeg(_picture(2160, 3840), progressive=True, subsampling=0))):
        path = tmp_path / name
        path.write_bytes(blob)
        out = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(small)], capture_output=True, text=True,
                             cwd=ROOT, check=True)
        peak, charged = map(int, out.stdout.split())
        assert peak <= charged, f"{name}: decoding peaked at {peak / (3840 * 2160):.2f} B/px, charged " \
                                f"{charged / (3840 * 2160):.2f}"


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
    frame = _picture(32, 32)
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
