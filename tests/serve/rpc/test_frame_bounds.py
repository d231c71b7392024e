"""Bounded work per frame: an encoded frame's structure is read before it is decoded (a scan bomb is
refused in milliseconds, marker abuse too), decoding stops past its CPU time, real JPEGs and PNGs of
every mode decode as before, and the pixel budget is charged the decoder's measured peak."""

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
from frame_cases import jpeg, picture, scan_bomb
from PIL import Image

from serve.rpc import Limits, RequestError, parse_submission
from serve.rpc.frames import open_frame, peak_pixels

ROOT = Path(__file__).resolve().parents[3]


def _spec(**fields) -> str:
    return json.dumps({"prompt": "Describe.", "frames": [], **fields})


@pytest.fixture(scope="module")
def progressive_4k() -> bytes:
    return jpeg(picture(2160, 3840), progressive=True)


def test_a_scan_bomb_is_refused_in_milliseconds(progressive_4k):
    bomb = scan_bomb(progressive_4k, 100_000)
    start = time.perf_counter()
    with pytest.raises(RequestError, match=r"frame 0: the JPEG stream has more than 64 scans \(rpc.max_jpeg_scans") \
            as refused:
        open_frame(bomb, {"format": "encoded"}, Limits(), 0)
    assert time.perf_counter() - start < 0.5 and refused.value.kind == "too_large"


def test_real_jpegs_still_decode_as_before(progressive_4k):
    import cv2

    small = picture(96, 128)
    ok, opencv = cv2.imencode(".jpg", small[:, :, ::-1])
    for blob in (progressive_4k, jpeg(small, progressive=True, subsampling=0), opencv.tobytes(), jpeg(small)):
        frame = open_frame(blob, {"format": "encoded"}, Limits(), 0).decode()
        with Image.open(io.BytesIO(blob)) as img:
            assert np.array_equal(frame, np.asarray(img.convert("RGB")))
        assert frame.flags.writeable and frame.flags.c_contiguous


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "CMYK", "I;16", "LA"])
def test_every_mode_decodes_to_the_same_rgb_as_a_whole_image_convert(mode):
    img = Image.fromarray(picture(70, 90))
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
    img = picture(16, 16)
    png = io.BytesIO()
    Image.fromarray(img).save(png, format="PNG")
    data = blob(jpeg(img), png.getvalue())
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


# ---- the pixel budget ---------------------------------------------------------------------------
def test_the_budget_is_charged_the_decoders_peak_of_the_largest_frame():
    import cv2

    small, big = picture(32, 32), picture(64, 64)
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
    progressive = open_frame(jpeg(big, progressive=True, subsampling=0), {"format": "encoded"}, Limits(), 0)
    assert progressive.peak_pixels == int(np.ceil(64 * 64 * 10.5 / 3))


MEASURE = """
import sys
from serve.rpc import Limits
from serve.rpc.frames import open_frame
blob = open(sys.argv[1], "rb").read()
open_frame(open(sys.argv[2], "rb").read(), {"format": "encoded"}, Limits(), 0).decode()  # warm
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

    ok, png = cv2.imencode(".png", picture(2160, 3840))
    small = tmp_path / "small.png"
    Image.fromarray(picture(64, 64)).save(small)
    for name, blob in (("png", png.tobytes()), ("progressive", progressive_4k),
                       ("progressive444", jpeg(picture(2160, 3840), progressive=True, subsampling=0))):
        path = tmp_path / name
        path.write_bytes(blob)
        out = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(small)], capture_output=True, text=True,
                             cwd=ROOT, check=True)
        peak, charged = map(int, out.stdout.split())
        assert peak <= charged, f"{name}: decoding peaked at {peak / (3840 * 2160):.2f} B/px, charged " \
                                f"{charged / (3840 * 2160):.2f}"


