"""What travels between client and server, and its validation.

Only plain immutable values cross the connection: a JSON string describing the request and a
tuple of `bytes` blobs (one per image or frame). Nothing is ever passed by reference, so the
server never calls back into a client object (RPyC netrefs are refused outright) and a client
cannot hand the server an object whose methods run on the client's terms.

Frame specs (one per blob, in the request's `frames` list):
    {"format": "encoded"}                                  PNG / JPEG / WebP bytes
    {"format": "raw", "shape": [H, W, 3], "dtype": "uint8"}  packed RGB pixels
"""

from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from serve.orchestrator.types import check_priority

KINDS = ("image", "video")
ENCODED_FORMATS = ("JPEG", "PNG")  # encoded frames; anything else is sent raw
# adapter names over the wire: no path separators, NUL or control characters, and short
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
OUTPUT_MODES = ("generate", "head")
SAMPLING_KEYS = {"temperature": float, "top_p": float, "top_k": int, "max_tokens": int, "seed": int,
                 "stop_token_ids": list, "ignore_eos": bool}
REQUEST_KEYS = {"prompt", "adapter", "task", "output_mode", "sampling", "app", "slo_ms", "frames", "tag"}


class RequestError(ValueError):
    """Bad input from a client: answered to that client, never fatal to the server."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind  # a stable machine-readable reason: "bad_frame", "too_large", ...

    def to_dict(self) -> dict[str, str]:
        return {"type": self.kind, "message": str(self)}


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 64 << 20  # all blobs of one request together
    max_frame_pixels: int = 3840 * 2160
    # decoded pixels of one request (30 frames of 1080p fit), and of every request the server holds
    # at once, over all connections: a few MB of PNG must not become gigabytes of frames
    max_request_pixels: int = 1 << 26
    max_pixels_in_flight: int = 1 << 28
    max_images: int = 8
    max_frames: int = 64  # frames of one video chunk (1 s at 30 fps is 30)
    max_prompt_chars: int = 8192
    max_new_tokens: int = 1024
    max_queued_per_connection: int = 256
    # before the token: the whole handshake line within this many seconds; at most max_handshakes
    # sockets in their handshake at once (0: as many as max_connections)
    handshake_timeout_s: float = 5.0
    max_handshakes: int = 0
    # the door (serve.rpc.door): at most this many of one source address wait at once (a new one
    # drops that address's longest-idle socket); the line's first byte within first_byte_timeout_s;
    # an authenticated connection that sends no message for idle_timeout_s is closed (a poll in progress is not idle)
    max_handshakes_per_address: int = 16
    first_byte_timeout_s: float = 1.0
    idle_timeout_s: float = 300.0
    # finished results a connection has not polled: kept at most this long, and at most this many
    # (the oldest go first; 0: as many as max_queued_per_connection)
    result_ttl_s: float = 600.0
    max_unpolled_per_connection: int = 0
    # run-time adapter loading (load_adapter): only from directories under this root; "" = off
    adapter_root: str = ""
    # the orchestrator's priority of each application's requests (by the `app` a client names; others
    # get 1.0): set by the operator, so a client cannot raise its own
    app_priorities: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for app, value in self.app_priorities.items():
            check_priority(value, f"rpc.app_priorities[{app!r}]")

    def priority(self, app: str | None) -> float:
        return float(self.app_priorities.get(app, 1.0)) if app is not None else 1.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Limits":
        fields = cls.__dataclass_fields__
        cast = {"float": float, "int": int, "str": lambda v: "" if v is None else str(v),  # annotations are strings
                "dict[str, float]": lambda v: {str(k): x for k, x in dict(v or {}).items()}}
        return cls(**{k: cast[fields[k].type](v) for k, v in d.items() if k in fields})


@dataclass
class Submission:
    """A validated request: decoded RGB frames plus the fields the engine's Request takes."""

    kind: str
    prompt: str
    frames: list[np.ndarray]  # uint8 [H, W, 3] each
    adapter: str | None
    task: str | None  # which of the adapter's heads answers (a domain or task name)
    output_mode: str
    sampling: dict[str, Any]
    app: str | None
    slo_ms: float | None
    tag: str | None  # the client's own label, echoed back in every event
    release: Callable[[], None] = lambda: None  # gives the decoded pixels back to the server's budget


def _is_plain(value: Any) -> bool:
    return type(value) in (str, bytes, int, float, bool, type(None))


def _check_type(name: str, value: Any, types: tuple[type, ...]) -> None:
    if type(value) not in types:  # exact types: bool is not an int here, a netref is nothing
        wanted = " or ".join(t.__name__ for t in types)
        raise RequestError("bad_argument", f"{name} must be {wanted}, got {type(value).__name__}")


def _parse_spec(spec_json: Any, limits: Limits) -> dict[str, Any]:
    _check_type("request spec", spec_json, (str,))
    # the prompt limit counts characters of the prompt, checked after parsing; the JSON may spell one
    # character in up to 12 (an escaped surrogate pair, as for an emoji), so this bound only stops the absurd
    if len(spec_json) > 12 * limits.max_prompt_chars + 65536:
        raise RequestError("too_large", f"request spec of {len(spec_json)} characters is too long")
    try:
        spec = json.loads(spec_json)
    except json.JSONDecodeError as e:
        raise RequestError("bad_argument", f"request spec is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise RequestError("bad_argument", f"request spec must be a JSON object, got {type(spec).__name__}")
    unknown = set(spec) - REQUEST_KEYS
    if unknown:
        raise RequestError("bad_argument", f"unknown request fields {sorted(unknown)}; known: {sorted(REQUEST_KEYS)}")
    return spec


def _sampling(raw: Any, limits: Limits) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RequestError("bad_argument", f"sampling must be an object, got {type(raw).__name__}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in SAMPLING_KEYS:
            raise RequestError("bad_argument", f"unknown sampling field {key!r}; known: {sorted(SAMPLING_KEYS)}")
        want = SAMPLING_KEYS[key]
        ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok or (isinstance(value, float) and not math.isfinite(value)):
            raise RequestError("bad_argument", f"sampling.{key} must be a finite {want.__name__}, got {value!r}")
        if key == "stop_token_ids":
            if not all(type(t) is int and t >= 0 for t in value) or len(value) > 64:
                raise RequestError("bad_argument", "sampling.stop_token_ids must be at most 64 token ids >= 0")
            value = tuple(value)
        out[key] = value
    if not 1 <= out.get("max_tokens", 1) <= limits.max_new_tokens:
        raise RequestError("too_large", f"sampling.max_tokens must lie in [1, {limits.max_new_tokens}], "
                                        f"got {out['max_tokens']}")
    if out.get("temperature", 0.0) < 0 or not 0 < out.get("top_p", 1.0) <= 1 or out.get("top_k", 0) < 0:
        raise RequestError("bad_argument", "sampling needs temperature >= 0, top_p in (0, 1] and top_k >= 0")
    return out


def check_adapter_name(name: Any) -> str:
    if type(name) is not str or not ADAPTER_NAME.fullmatch(name):
        raise RequestError("bad_argument", "an adapter name is 1-128 letters, digits, '.', '_' or '-', starting with "
                                           "a letter or digit")
    return name


def open_frame(blob: Any, spec: Any, limits: Limits, index: int,
               keep_jpeg: bool = False) -> tuple[tuple[int, int], Callable[[], np.ndarray | bytes]]:
    """One frame spec + blob -> ((H, W), read from the spec or the image header, and a function that
    decodes it to uint8 [H, W, 3] RGB): sizes are known, and checked, before any pixel is decoded.
    keep_jpeg: a JPEG frame stays encoded (the engine decodes it on its device); its bytes must
    end with the end-of-image marker, so a truncated file is refused here."""
    name = f"frame {index}"
    _check_type(f"{name} data", blob, (bytes,))
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
        return (shape[0], shape[1]), lambda: np.frombuffer(blob, dtype=np.uint8).reshape(shape).copy()
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
        if not blob.rstrip(b"\x00").endswith(b"\xff\xd9"):
            raise RequestError("bad_frame", f"{name}: the JPEG data is truncated (no end-of-image marker)")
        return (height, width), lambda: blob

    def decode() -> np.ndarray:
        try:
            with Image.open(io.BytesIO(blob), formats=ENCODED_FORMATS) as img:
                img.load()  # a truncated file fails here rather than yielding a half-grey frame
                return np.ascontiguousarray(np.asarray(img.convert("RGB")))
        except Exception as e:  # PIL raises many types for corrupt data
            raise RequestError("bad_frame", f"{name}: cannot decode image bytes ({type(e).__name__}: {e})") from None

    return (height, width), decode


def decode_frame(blob: Any, spec: Any, limits: Limits, index: int) -> np.ndarray:
    """One frame spec + blob -> uint8 [H, W, 3] RGB, with the pixel count checked before decoding."""
    return open_frame(blob, spec, limits, index)[1]()


def parse_submission(kind: str, spec_json: Any, blobs: Any, limits: Limits, reserve=None,
                     keep_jpeg: bool = False) -> Submission:
    """Validate a request from the wire. Raises RequestError naming the first bad input.
    reserve(pixels) -> release: called once the decoded size is known and before decoding, to take
    that many pixels from the server's budget (it raises RequestError when the budget is spent);
    the returned release is the Submission's, called here if decoding fails."""
    if kind not in KINDS:
        raise RequestError("bad_argument", f"kind must be one of {KINDS}, got {kind!r}")
    spec = _parse_spec(spec_json, limits)
    prompt = spec.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("bad_argument", "prompt must be a non-empty string")
    if len(prompt) > limits.max_prompt_chars:
        raise RequestError("too_large", f"prompt of {len(prompt)} characters exceeds {limits.max_prompt_chars}")
    _check_type("frames data", blobs, (tuple,))
    specs = spec.get("frames")
    if not isinstance(specs, list) or len(specs) != len(blobs):
        raise RequestError("bad_argument", f"frames must list one spec per data blob: {len(blobs)} blobs, "
                                           f"specs {'missing' if specs is None else len(specs) if isinstance(specs, list) else 'not a list'}")
    most = limits.max_images if kind == "image" else limits.max_frames
    if kind == "video" and not blobs:
        raise RequestError("bad_argument", "a video chunk needs at least one frame")
    if len(blobs) > most:
        raise RequestError("too_large", f"{len(blobs)} {kind} frames exceed the limit of {most}")
    if not all(_is_plain(b) for b in blobs):
        raise RequestError("bad_argument", "frame data must be bytes values (references are refused)")
    total = sum(len(b) for b in blobs if type(b) is bytes)
    if total > limits.max_message_bytes:
        raise RequestError("too_large", f"{total} bytes of frames exceed {limits.max_message_bytes}")
    adapter, mode, app, tag = spec.get("adapter"), spec.get("output_mode", "generate"), spec.get("app"), spec.get("tag")
    task = spec.get("task")
    for name, value in (("adapter", adapter), ("task", task), ("app", app), ("tag", tag)):
        if value is not None and (not isinstance(value, str) or len(value) > 256):
            raise RequestError("bad_argument", f"{name} must be a string of at most 256 characters or null")
    if adapter is not None:
        check_adapter_name(adapter)
    if mode not in OUTPUT_MODES:
        raise RequestError("bad_argument", f"output_mode must be one of {OUTPUT_MODES}, got {mode!r}")
    slo = spec.get("slo_ms")
    if slo is not None and (isinstance(slo, bool) or not isinstance(slo, (int, float)) or not 0 < slo < 1e9):
        raise RequestError("bad_argument", f"slo_ms must be a positive number of milliseconds, got {slo!r}")
    sampling = _sampling(spec.get("sampling"), limits)
    # every check that needs no pixels is done: read the frames' sizes, then decode within the budget
    opened = [open_frame(b, s, limits, i, keep_jpeg and kind == "video") for i, (b, s) in enumerate(zip(blobs, specs))]
    if kind == "video" and len({size for size, _ in opened}) > 1:
        raise RequestError("bad_frame", "the frames of a video chunk must share one shape, got "
                                        f"{sorted({(h, w, 3) for (h, w), _ in opened})}")
    pixels = sum(h * w for (h, w), _ in opened)
    if pixels > limits.max_request_pixels:
        raise RequestError("too_large", f"the {len(opened)} frames hold {pixels} pixels decoded, over the request "
                                        f"limit of {limits.max_request_pixels}")
    release = reserve(pixels) if reserve is not None else (lambda: None)
    try:
        frames = [decode() for _, decode in opened]
    except BaseException:
        release()
        raise
    return Submission(kind, prompt, frames, adapter, task, mode, sampling, app, None if slo is None else float(slo),
                      tag, release)


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
