"""Encoded frames for the door's tests: pictures with real data to code, and the scan bomb."""

from __future__ import annotations

import io
import re
import struct

import numpy as np
from PIL import Image


def picture(height: int, width: int) -> np.ndarray:
    """uint8 [H, W, 3]: gradients and a pattern, so JPEG and PNG both have data to code."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // width, y * 255 // height, (x * y) % 251], -1).astype(np.uint8)


def jpeg(img: np.ndarray, **options) -> bytes:
    """PIL's JPEG of `img` (options: progressive=True, subsampling=0, ...)."""
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90, **options)
    return buf.getvalue()


def scan_bomb(progressive: bytes, scans: int) -> bytes:
    """`progressive` with `scans` empty copies of its last scan's header before its end-of-image marker:
    each costs the decoder a pass over the whole image (100,000 at 4K: ~43 s), for 10 bytes."""
    at = [m.start() for m in re.finditer(rb"\xff\xda", progressive)][-1]
    header = progressive[at:at + 2 + struct.unpack_from(">H", progressive, at + 2)[0]]
    end = progressive.rindex(b"\xff\xd9")
    return progressive[:end] + header * scans + progressive[end:]
