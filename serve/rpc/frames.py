"""Frames from the wire to uint8 [H, W, 3] RGB arrays, at a cost known before any pixel is decoded.

Frame specs (one per blob, in the request's `frames` list):
    {"format": "encoded"}                                  PNG / JPEG bytes
    {"format": "raw", "shape": [H, W, 3], "dtype": "uint8"}  packed RGB pixels

What decoding one frame may cost, and how each bound is kept:
- pixels: the size is read from the spec or the image header (rpc.max_frame_pixels);
- work: a JPEG's scans and segments and a PNG's chunks are counted from the bytes (serve.rpc.markers,
  rpc.max_jpeg_scans, rpc.max_png_chunks), so work is linear in pixels plus bytes; and the decoder
  reads its input through a clock that stops it past rpc.max_decode_cpu_s of the thread's CPU time;
- memory: decoding peaks at a measured number of bytes a pixel (DECODE_PEAK_BYTES_PER_PIXEL, more for
  a JPEG of several scans), and the pixel budget is charged that peak (`OpenedFrame.peak_pixels`).
"""

from __future__ import annotations

import io
import math
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np

from .errors import RequestError
from .markers import JpegInfo, check_jpeg, check_png

if TYPE_CHECKING:
    from .wire import Limits

ENCODED_FORMATS = ("JPEG", "PNG")  # encoded frames; anything else is sent raw
FRAME_BYTES_PER_PIXEL = 3  # what the budget's pixel stands for: one decoded uint8 RGB pixel
# Peak resident memory of decoding one encoded frame to its uint8 RGB array, in bytes per pixel,
# measured as the VmHWM rise of a fresh process per 3840x2160 frame (python -m bench.frame_decode at fd328ee,
# Pillow 12.3): Pillow's image (4 bytes a pixel for RGB, RGBA and CMYK) plus the 3-byte result and
# a band in between: 7.3-7.4 for baseline JPEG and RGB or RGBA PNG (4.3 for grey and palette). The
# previous path (convert, then np.asarray through tobytes, which joins a second copy) peaked at 14.0.
DECODE_PEAK_BYTES_PER_PIXEL = 7.5
# A JPEG of several scans (progressive, or sequential in several) also keeps every DCT coefficient,
# 2 bytes each, beside Pillow's image until its last scan is read, but not yet the result:
# 4 + 2 x coefficients a pixel (+ the same margin), measured 10.0 for progressive 4:4:4 (3 a pixel)
# and 12.0 for progressive CMYK (4 a pixel); progressive 4:2:0 (1.5 a pixel) stays at 7.4
PILLOW_IMAGE_BYTES_PER_PIXEL, COEFFICIENT_BYTES = 4, 2
_MARGIN = DECODE_PEAK_BYTES_PER_PIXEL - PILLOW_IMAGE_BYTES_PER_PIXEL - FRAME_BYTES_PER_PIXEL
_BAND_BYTES = 1 << 20  # rows copied out of Pillow's image at a time: a small transient, not a second image


class OpenedFrame(NamedTuple):
    size: tuple[int, int]  # (H, W), known before decoding
    decode: Callable[[], np.ndarray | bytes]  # -> uint8 [H, W, 3] RGB (or the JPEG bytes, when kept encoded)
    peak_pixels: int  # the budget's pixels while decoding: the frame itself plus the decoder's transient


def peak_pixels(pixels: int, jpeg: JpegInfo | None = None) -> int:
    """Budget pixels (3 bytes each) that decoding an encoded frame of `pixels` pixels holds at its peak."""
    per_pixel = DECODE_PEAK_BYTES_PER_PIXEL
    if jpeg is not None and jpeg.buffers_coefficients:
        coefficients = COEFFICIENT_BYTES * jpeg.coefficients_per_pixel
        per_pixel = max(per_pixel, PILLOW_IMAGE_BYTES_PER_PIXEL + coefficients + _MARGIN)
    return math.ceil(pixels * per_pixel / FRAME_BYTES_PER_PIXEL)


class _Clocked(io.BytesIO):
    """The decoder's input, read in blocks (Pillow reads 64 KB per decoder call): each read first checks
    the thread's CPU time, so a decode that runs past its bound stops at its next block."""

    def __init__(self, blob: bytes, limit_s: float, name: str):
        super().__init__(blob)
        self.limit_s, self.name = limit_s, name
        self.until = time.thread_time() + limit_s

    def check(self) -> None:
        if time.thread_time() > self.until:
            raise RequestError("too_large", f"{self.name}: decoding took more than {self.limit_s:g} s of CPU time "
                                            "(rpc.max_decode_cpu_s)")

    def read(self, size: int | None = -1) -> bytes:
        self.check()
        return super().read(size)


def _to_array(img, clock: _Clocked) -> np.ndarray:
    """Pillow's image (RGB inside at 4 bytes a pixel; L, P, RGBA, CMYK, I;16) -> a new uint8 [H, W, 3] RGB
    array, band by band: a whole-image convert would hold a second 4-byte image, and np.asarray goes
    through tobytes, which joins yet another copy."""
    width, height = img.size
    out = np.empty((height, width, 3), np.uint8)
    rows = max(1, _BAND_BYTES // (4 * width))
    for top in range(0, height, rows):
        bottom = min(height, top + rows)
        band = img.crop((0, top, width, bottom))
        if band.mode != "RGB":
            band = band.convert("RGB")
        out[top:bottom] = np.frombuffer(band.tobytes(), np.uint8).reshape(bottom - top, width, 3)
        clock.check()
    return out


def _decode_encoded(blob: bytes, name: str, limit_s: float) -> np.ndarray:
    from PIL import Image

    clock = _Clocked(blob, limit_s, name)
    with Image.open(clock, formats=ENCODED_FORMATS) as img:
        img.load()  # a truncated file fails here rather than yielding a half-grey frame
        return _to_array(img, clock)


def open_frame(blob: Any, spec: Any, limits: "Limits", index: int, keep_jpeg: bool = False) -> OpenedFrame:
    """One frame spec + blob -> its size, read from the spec or the image header, a function that decodes
    it, and the budget it holds while decoding: sizes and structure are checked before any pixel is decoded.
    keep_jpeg: a JPEG frame stays encoded (the engine decodes it on its device)."""
    name = f"frame {index}"
    if type(blob) is not bytes:
        raise RequestError("bad_argument", f"{name} data must be bytes, got {type(blob).__name__}")
    if not isinstance(spec, dict) or spec.get("format") not in ("encoded", "raw"):
        raise RequestError("bad_frame", f"{name}: spec must be {{'format': 'encoded'}} or "
                                        "{'format': 'raw', 'shape': [H, W, 3], 'dtype': 'uint8'}")
    if spec["format"] == "raw":
        shape, dtype = spec.get("shape"), spec.get("dtype")
        if dtype != "uint8" or not isinstance(shape, list) or len(shape) != 3 or shape[2] != 3 or \
                not all(type(s) is int and s > 0 for s in shape):
            raise RequestError("bad_frame", f"{name}: raw frames must be dtype 'uint8' with shape [H, W, 3], "
                                            f"got dtype {dtype!r} shape {shape!r}")
        if shape[0] * shape[1] > limits.max_frame_pixels:
            raise RequestError("too_large", f"{name}: {shape[0]}x{shape[1]} exceeds {limits.max_frame_pixels} pixels")
        if len(blob) != shape[0] * shape[1] * 3:
            raise RequestError("bad_frame", f"{name}: {len(blob)} bytes do not hold a uint8 array of shape {shape}")
        # one copy, the frame itself: the blob is already held
        return OpenedFrame((shape[0], shape[1]), lambda: np.frombuffer(blob, dtype=np.uint8).reshape(shape).copy(),
                           shape[0] * shape[1])
    # the structure first: Pillow's own header parsing walks every segment before the first scan
    jpeg = None
    if blob[:2] == b"\xff\xd8":
        jpeg = check_jpeg(blob, name, limits.max_jpeg_scans)
    elif blob[:8] == b"\x89PNG\r\n\x1a\n":
        check_png(blob, name, limits.max_png_chunks)
    from PIL import Image, UnidentifiedImageError

    try:  # JPEG and PNG only: Pillow would otherwise try every format it knows (TIFF, ICO, EPS via Ghostscript)
        with Image.open(io.BytesIO(blob), formats=ENCODED_FORMATS) as img:
            width, height = img.size  # read from the header: a decompression bomb is refused undecoded
            fmt, mode = img.format, img.mode
    except UnidentifiedImageError:
        raise RequestError("bad_frame", f"{name}: not a JPEG or PNG image (the formats accepted encoded; "
                                        "send other pictures as raw uint8 frames)") from None
    except Exception as e:  # PIL raises many types for corrupt data
        raise RequestError("bad_frame", f"{name}: cannot read the image header ({type(e).__name__}: {e})") from None
    if width * height > limits.max_frame_pixels:
        raise RequestError("too_large", f"{name}: {width}x{height} exceeds {limits.max_frame_pixels} pixels")
    if keep_jpeg and fmt == "JPEG" and mode in ("RGB", "L"):
        return OpenedFrame((height, width), lambda: blob, width * height)  # checked to end with its EOI above

    def decode() -> np.ndarray:
        try:
            return _decode_encoded(blob, name, limits.max_decode_cpu_s)
        except RequestError:
            raise
        except Exception as e:  # PIL raises many types for corrupt data
            raise RequestError("bad_frame", f"{name}: cannot decode image bytes ({type(e).__name__}: {e})") from None

    return OpenedFrame((height, width), decode, peak_pixels(width * height, jpeg if fmt == "JPEG" else None))


def decode_frame(blob: Any, spec: Any, limits: "Limits", index: int) -> np.ndarray:
    """One frame spec + blob -> uint8 [H, W, 3] RGB, with the pixel count checked before decoding."""
    return open_frame(blob, spec, limits, index).decode()


def encode_frame(frame: np.ndarray, encoding: str = "png", quality: int = 90) -> tuple[dict[str, Any], bytes]:
    """Client side: an RGB uint8 [H, W, 3] array -> (spec, blob). `png` and `raw` are lossless."""
    if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
        raise ValueError(f"a frame must be a uint8 [H, W, 3] RGB array, got "
                         f"{getattr(frame, 'dtype', type(frame).__name__)} {getattr(frame, 'shape', '')}")
    if encoding == "raw":
        return {"format": "raw", "shape": list(frame.shape), "dtype": "uint8"}, np.ascontiguousarray(frame).tobytes()
    if encoding not in ("png", "jpeg"):
        raise ValueError(f"encoding must be png, jpeg or raw, got {encoding!r}")
    import cv2

    params = [cv2.IMWRITE_JPEG_QUALITY, quality] if encoding == "jpeg" else []
    ok, buf = cv2.imencode("." + ("jpg" if encoding == "jpeg" else "png"), frame[:, :, ::-1], params)
    if not ok:
        raise ValueError(f"OpenCV could not encode a frame of shape {frame.shape} as {encoding}")
    return {"format": "encoded"}, buf.tobytes()
