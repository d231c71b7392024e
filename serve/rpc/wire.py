"""What travels between client and server, and its validation.

Only plain immutable values cross the connection: a JSON string describing the request and a
tuple of `bytes` blobs (one per image or frame, see serve.rpc.frames). Nothing is ever passed by
reference, so the server never calls back into a client object (RPyC netrefs are refused outright)
and a client cannot hand the server an object whose methods run on the client's terms.

Every number a request carries has a floor and a ceiling (finite only), chosen so that no value
that passes can make the engine or its policy fail; an error names the field and its bounds:
    slo_ms                [1, 3,600,000]    a latency target of 1 ms to 1 h; the policy divides by it
    sampling.temperature  0, or [0.01, 100] 0 is greedy; logits / t overflows float32 as t nears 0
    sampling.top_p        [1e-6, 1]         in float32 a smaller value is 0 and cuts every token
    sampling.top_k        [0, 1,000,000]    0 is off; above any vocabulary it is off too
    sampling.max_tokens   [1, rpc.max_new_tokens]
    sampling.seed         [0, 2**63 - 1]    a torch generator's seed
    sampling.stop_token_ids  at most 64, each in [0, 2**31 - 1]
Text fields (prompt, adapter, task, app, tag) must encode as UTF-8: a lone surrogate is refused
with its position, here rather than by the tokenizer's own message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from serve.orchestrator.types import check_priority

from .errors import RequestError
from .frames import ENCODED_FORMATS, decode_frame, encode_frame, open_frame  # noqa: F401 (the package's face)

KINDS = ("image", "video")
# adapter names over the wire: no path separators, NUL or control characters, and short
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
OUTPUT_MODES = ("generate", "head")
SAMPLING_KEYS = {"temperature": float, "top_p": float, "top_k": int, "max_tokens": int, "seed": int,
                 "stop_token_ids": list, "ignore_eos": bool}
# [floor, ceiling] of each number (max_tokens' ceiling is rpc.max_new_tokens); see the module docstring
SAMPLING_BOUNDS = {"temperature": (0.01, 100.0), "top_p": (1e-6, 1.0), "top_k": (0, 1_000_000),
                   "seed": (0, 2**63 - 1)}
SLO_MS_BOUNDS = (1.0, 3_600_000.0)
MAX_STOP_TOKENS, MAX_TOKEN_ID = 64, 2**31 - 1
TEXT_FIELDS = ("prompt", "adapter", "task", "app", "tag")
REQUEST_KEYS = {"prompt", "adapter", "task", "output_mode", "sampling", "app", "slo_ms", "frames", "tag"}


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
    # the work of decoding one encoded frame (serve.rpc.frames): a progressive JPEG's decoder passes
    # over the whole image once per scan (real files have ~10; an empty one costs ~0.5 ms at 4K: 64 cost
    # ~30 ms, 100,000 ~50 s); a PNG's chunks are walked one by one (libpng writes 8 KB of image data per chunk);
    # and a decode that still runs past max_decode_cpu_s of CPU time is stopped (4K: 0.1-0.3 s)
    max_jpeg_scans: int = 64
    max_png_chunks: int = 65536
    max_decode_cpu_s: float = 5.0
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
    # the connection threads' turns (serve/rpc/gate.py): at most gate_slots run service code at once,
    # together at most gate_share of the wall clock, split between the tenants calling by weight
    gate_slots: int = 1
    gate_share: float = 0.5  # measured against 1.0 on CPU and an H200 machine: results/fairness, results/soak
    # added to the niceness of each tenant's front-end process (serve/rpc/tenant_processes.py): on a
    # machine with fewer free cores than busy processes, the engine's step loop runs before the front ends
    tenant_process_nice: int = 0
    # the tenant processes' connection threads paced as the server's own, by gate_share split between
    # the tenants calling in every front-end process (serve/rpc/shared_clock.py); off: each tenant's
    # process runs its calls unpaced
    pace_tenant_processes: bool = False
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
        if not 0 <= self.tenant_process_nice <= 19:
            raise ValueError(f"rpc.tenant_process_nice={self.tenant_process_nice}: give 0-19 (added to the tenant "
                             "front-end processes' niceness)")
        for app, value in self.app_priorities.items():
            check_priority(value, f"rpc.app_priorities[{app!r}]")

    def priority(self, app: str | None) -> float:
        return float(self.app_priorities.get(app, 1.0)) if app is not None else 1.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Limits":
        """The limits of a config's `rpc` section (other keys ignored); ValueError naming the key of a
        value that is not of its kind."""
        fields = cls.__dataclass_fields__
        cast = {"float": float, "int": int, "str": lambda v: "" if v is None else str(v),  # annotations are strings
                "bool": _strict_bool, "dict[str, float]": lambda v: {str(k): x for k, x in dict(v or {}).items()}}
        values = {}
        for k, v in d.items():
            if k not in fields:
                continue
            kind = fields[k].type
            if kind in ("int", "float") and (isinstance(v, bool) or not isinstance(v, (int, float)) or kind == "int"
                                             and isinstance(v, float) and not v.is_integer()):
                raise ValueError(f"rpc.{k}={v!r}: give {'an integer' if kind == 'int' else 'a number'}")
            try:
                values[k] = cast[kind](v)
            except (TypeError, ValueError) as e:
                raise ValueError(f"rpc.{k}={v!r}: {e}") from None
        return cls(**values)


def _strict_bool(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError("give true or false")
    return value


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
        spec = json.loads(spec_json, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise RequestError("bad_argument", f"request spec is not valid JSON: {e}") from None
    except RecursionError:  # [[[[...]]]] a hundred thousand deep
        raise RequestError("bad_argument", "request spec is nested too deeply") from None
    except ValueError as e:  # an integer of more than 4,300 digits (Python's own bound), NaN or Infinity
        raise RequestError("bad_argument", f"request spec holds a number out of range ({str(e)[:100]})") from None
    if not isinstance(spec, dict):
        raise RequestError("bad_argument", f"request spec must be a JSON object, got {type(spec).__name__}")
    unknown = set(spec) - REQUEST_KEYS
    if unknown:
        names = ", ".join(repr(k[:64]) for k in sorted(unknown)[:4])
        raise RequestError("bad_argument", f"unknown request fields {names}; known: {sorted(REQUEST_KEYS)}")
    return spec


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a finite number")


def _bounded(name: str, value: Any, want: type, low: float, high: float) -> Any:
    """`value` as a finite `want` within [low, high], else a RequestError naming the field and its bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (want is int and not isinstance(value, int)):
        raise RequestError("bad_argument", f"{name} must be {'an integer' if want is int else 'a number'}, "
                                           f"got {type(value).__name__}")
    if not low <= value <= high:  # exact for ints of any size; false for NaN and the infinities
        shown = f"an integer of {len(str(abs(value)))} digits" if isinstance(value, int) and abs(value) > 10**30 \
            else repr(value)
        raise RequestError("bad_argument", f"{name} must lie in [{_number(low)}, {_number(high)}], got {shown}")
    return float(value) if want is float else value


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e19 else f"{x:g}"


def _sampling(raw: Any, limits: Limits) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RequestError("bad_argument", f"sampling must be an object, got {type(raw).__name__}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in SAMPLING_KEYS:
            raise RequestError("bad_argument", f"unknown sampling field {key[:64]!r}; known: {sorted(SAMPLING_KEYS)}")
        name = f"sampling.{key}"
        if key == "ignore_eos":
            if type(value) is not bool:
                raise RequestError("bad_argument", f"{name} must be true or false, got {type(value).__name__}")
        elif key == "stop_token_ids":
            if not isinstance(value, list) or len(value) > MAX_STOP_TOKENS:
                raise RequestError("bad_argument", f"{name} must be a list of at most {MAX_STOP_TOKENS} token ids")
            value = tuple(_bounded(f"{name}[{i}]", t, int, 0, MAX_TOKEN_ID) for i, t in enumerate(value))
        elif key == "max_tokens":
            if isinstance(value, int) and not isinstance(value, bool) and value > limits.max_new_tokens:
                raise RequestError("too_large", f"{name} must lie in [1, {limits.max_new_tokens}] "
                                                f"(rpc.max_new_tokens), got {value}")
            value = _bounded(name, value, int, 1, limits.max_new_tokens)
        elif key == "temperature" and type(value) in (int, float) and value == 0:
            value = 0.0  # greedy
        elif key == "temperature":
            try:
                value = _bounded(name, value, float, *SAMPLING_BOUNDS[key])
            except RequestError as e:
                raise RequestError(e.kind, f"{e} (or 0: greedy)") from None
        else:
            value = _bounded(name, value, SAMPLING_KEYS[key], *SAMPLING_BOUNDS[key])
        out[key] = value
    return out


def _check_text(name: str, value: str) -> None:
    """Text must encode as UTF-8: JSON can carry a lone surrogate (\ud800), which no tokenizer takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError("bad_argument", f"{name} is not valid Unicode text: a lone surrogate "
                                           f"U+{ord(value[e.start]):04X} at character {e.start}") from None


def check_adapter_name(name: Any) -> str:
    if type(name) is not str or not ADAPTER_NAME.fullmatch(name):
        raise RequestError("bad_argument", "an adapter name is 1-128 letters, digits, '.', '_' or '-', starting with "
                                           "a letter or digit")
    return name


def parse_submission(kind: str, spec_json: Any, blobs: Any, limits: Limits, reserve=None,
                     keep_jpeg: bool = False) -> Submission:
    """Validate a request from the wire. Raises RequestError naming the first bad input.
    reserve(pixels) -> release: called once the decoded size is known and before decoding, to take
    that many pixels from the server's budget (it raises RequestError when the budget is spent);
    the returned release is the Submission's, called here if decoding fails. The pixels taken are the
    frames' own plus the decoder's transient of the largest frame (frames decode one at a time), all in
    one reservation held until the release: giving the transient back after decoding would need a
    second reservation, which could be refused with the decoding already paid for."""
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
    for name in TEXT_FIELDS:
        if isinstance(spec.get(name), str):
            _check_text(name, spec[name])
    if adapter is not None:
        check_adapter_name(adapter)
    if mode not in OUTPUT_MODES:
        raise RequestError("bad_argument", f"output_mode must be one of {OUTPUT_MODES}, got {str(mode)[:64]!r}")
    slo = spec.get("slo_ms")
    if slo is not None:
        slo = _bounded("slo_ms", slo, float, *SLO_MS_BOUNDS)
    sampling = _sampling(spec.get("sampling"), limits)
    # every check that needs no pixels is done: read the frames' sizes, then decode within the budget
    opened = [open_frame(b, s, limits, i, keep_jpeg and kind == "video") for i, (b, s) in enumerate(zip(blobs, specs))]
    if kind == "video" and len({f.size for f in opened}) > 1:
        raise RequestError("bad_frame", "the frames of a video chunk must share one shape, got "
                                        f"{sorted({(h, w, 3) for (h, w), _, _ in opened})}")
    pixels = sum(h * w for (h, w), _, _ in opened)
    if pixels > limits.max_request_pixels:
        raise RequestError("too_large", f"the {len(opened)} frames hold {pixels} pixels decoded, over the request "
                                        f"limit of {limits.max_request_pixels}")
    transient = max((f.peak_pixels - f.size[0] * f.size[1] for f in opened), default=0)
    release = reserve(pixels + transient) if reserve is not None else (lambda: None)
    try:
        frames = [f.decode() for f in opened]
    except BaseException:
        release()
        raise
    return Submission(kind, prompt, frames, adapter, task, mode, sampling, app, slo, tag, release)
