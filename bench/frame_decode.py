"""What decoding one encoded 4K frame costs the server, and what the door refuses before decoding.

    python -m bench.frame_decode [--size 3840x2160] [--bomb-scans 100000]

Peak memory: each (image kind, decode path) runs in a fresh process, which resets its high-water
mark (/proc/self/clear_refs) after warming the libraries on a small image and reports the VmHWM rise
while decoding, in bytes per pixel (tracemalloc does not see Pillow's or libjpeg's allocations).
`before` is the earlier path (load, convert, np.asarray, ascontiguousarray); `now` is
serve.rpc.frames. The largest `now` figure is serve.rpc.frames.DECODE_PEAK_BYTES_PER_PIXEL.

Attack: a progressive JPEG with `--bomb-scans` empty scans (the last scan's header repeated with no
data), timed through the door (serve.rpc.frames.open_frame) and, at a few hundred scans, through the
decoder, whose time per scan it extrapolates.
"""

from __future__ import annotations

import argparse
import io
import math
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MEASURE = r'''
import io, sys, numpy as np
from PIL import Image
from serve.rpc.frames import _decode_encoded

def before(blob):
    with Image.open(io.BytesIO(blob), formats=("JPEG", "PNG")) as img:
        img.load()
        return np.ascontiguousarray(np.asarray(img.convert("RGB")))

def now(blob):
    return _decode_encoded(blob, "frame 0", 60.0)

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

path, small, how = sys.argv[1:4]
decode = before if how == "before" else now
decode(open(small, "rb").read())  # libraries loaded and warm
blob = open(path, "rb").read()
open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current RSS
base = status("VmRSS:")
frame = decode(blob)
print((status("VmHWM:") - base) / (frame.shape[0] * frame.shape[1]))
'''


def test_image(height: int, width: int) -> np.ndarray:
    """Smooth gradients plus noise: JPEG and PNG both have real data to code."""
    y, x = np.mgrid[0:height, 0:width]
    img = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], -1)
    noise = np.random.default_rng(0).integers(-20, 20, img.shape)
    return np.clip(img + noise, 0, 255).astype(np.uint8)


def write_kinds(img: np.ndarray, folder: Path) -> dict[str, Path]:
    import cv2
    from PIL import Image

    pil = Image.fromarray(img)
    out = {"jpeg baseline 4:2:0 (OpenCV)": ("cv.jpg", None), "jpeg progressive 4:2:0": ("p420.jpg", dict(progressive=True)),
           "jpeg progressive 4:4:4": ("p444.jpg", dict(progressive=True, subsampling=0)),
           "jpeg progressive CMYK": ("cmyk.jpg", "CMYK"), "jpeg grey": ("grey.jpg", "L"),
           "png RGB (OpenCV)": ("cv.png", None), "png RGBA": ("rgba.png", "RGBA"), "png palette": ("p.png", "P")}
    paths = {}
    for kind, (name, how) in out.items():
        path = folder / name
        if "OpenCV" in kind:
            cv2.imwrite(str(path), img[:, :, ::-1])
        elif isinstance(how, dict):
            pil.save(path, quality=90, **how)
        elif how == "P":
            pil.quantize(256).save(path)
        else:
            pil.convert(how).save(path, **({"quality": 90, "progressive": True} if name.endswith("jpg") else {}))
        paths[kind] = path
    return paths


def scan_bomb(progressive: bytes, scans: int) -> bytes:
    """`progressive` with `scans` empty copies of its last scan's header before the end-of-image marker."""
    at = [m.start() for m in re.finditer(rb"\xff\xda", progressive)][-1]
    header = progressive[at:at + 2 + struct.unpack_from(">H", progressive, at + 2)[0]]
    end = progressive.rindex(b"\xff\xd9")
    return progressive[:end] + header * scans + progressive[end:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="3840x2160")
    ap.add_argument("--bomb-scans", type=int, default=100_000)
    args = ap.parse_args()
    width, height = map(int, args.size.split("x"))
    from PIL import Image

    from serve.rpc import Limits, RequestError
    from serve.rpc.frames import DECODE_PEAK_BYTES_PER_PIXEL, open_frame

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = write_kinds(test_image(height, width), folder)
        small = {s: folder / f"small.{s}" for s in ("jpg", "png")}
        for suffix, path in small.items():
            Image.fromarray(test_image(64, 64)).save(path)
        print(f"peak memory of decoding one {width}x{height} frame, bytes per pixel (VmHWM rise):")
        print(f"{'kind':32s} {'before':>7s} {'now':>7s} {'charged':>8s}")
        limits, worst = Limits(), -math.inf
        for kind, path in paths.items():
            row = []
            for how in ("before", "now"):
                out = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(small[path.suffix[1:]]), how],
                                     capture_output=True, text=True, check=True)
                row.append(float(out.stdout.strip()))
            charged = open_frame(path.read_bytes(), {"format": "encoded"}, limits, 0).peak_pixels * 3 / (width * height)
            worst = max(worst, row[1] - charged)
            print(f"{kind:32s} {row[0]:7.2f} {row[1]:7.2f} {charged:8.2f}")
        print(f"largest peak over its charge: {worst:+.2f} B/px (DECODE_PEAK_BYTES_PER_PIXEL = {DECODE_PEAK_BYTES_PER_PIXEL})")

        progressive = paths["jpeg progressive 4:2:0"].read_bytes()
        spec = {"format": "encoded"}
        bomb = scan_bomb(progressive, args.bomb_scans)
        start = time.perf_counter()
        try:
            open_frame(bomb, spec, limits, 0)
            verdict = "accepted"
        except RequestError as e:
            verdict = f"refused ({e.kind}: {e})"
        refusal_ms = (time.perf_counter() - start) * 1e3
        print(f"\nscan bomb: {args.bomb_scans} empty scans, {len(bomb) / 1e6:.2f} MB: {refusal_ms:.1f} ms at the door, "
              f"{verdict}")
        timings = {}
        for scans in (0, 400):
            start = time.perf_counter()
            with Image.open(io.BytesIO(scan_bomb(progressive, scans))) as img:
                img.load()
            timings[scans] = time.perf_counter() - start
        per_scan = (timings[400] - timings[0]) / 400
        print(f"decoding it would take ~{per_scan * args.bomb_scans:.0f} s ({per_scan * 1e3:.2f} ms a scan; "
              f"{timings[0] * 1e3:.0f} ms without the extra scans)")
        at_bound = scan_bomb(progressive, limits.max_jpeg_scans - 10)  # the file has 10 scans of its own
        start = time.perf_counter()
        opened = open_frame(at_bound, spec, limits, 0)
        opened.decode()
        print(f"at the bound ({limits.max_jpeg_scans} scans): door and decode {(time.perf_counter() - start) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
