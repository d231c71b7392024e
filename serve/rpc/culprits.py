"""What the engine thread remembers about requests that made a step fail, so that their kind is refused
at the door instead of costing every request in flight another restart.

A request charged with a failure (it fails when run alone, see serve/rpc/loop.py `_isolate`) is
probed once more: the same request with its prompt replaced by a neutral one and its frames by black
frames of the same sizes. If the probe fails too, the failure comes from the request's fields, and
its *kind* is remembered: adapter, task, output mode, every sampling value, app, slo_ms, priority and
the number and sizes of its frames (never its prompt or pixels). Any later request of that kind, from
anyone, would fail the same way and is refused. If the probe runs, the failure comes from the
content, and only that exact request (fields plus a hash of its prompt and frames) is refused: a
prompt that breaks the tokenizer must not get every request with default settings refused.

Both are kept in one bounded least-recently-used table (`MAX_KINDS`), read by connection threads
(`refuses`) and written by the engine thread (`record`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from .logs import clip

MAX_KINDS = 256
NEUTRAL_PROMPT = "Describe."


def _frames(request) -> list:
    video = request.video
    if video is None:
        return list(request.images)
    return list(video) if isinstance(video, (list, tuple)) else [video]


def _frame_sig(frame: Any) -> tuple:
    shape = getattr(frame, "shape", None)
    if shape is not None:  # an array: [H, W, 3] (an image or a frame) or [T, H, W, 3] (a whole clip)
        return ("array", tuple(int(n) for n in shape), str(getattr(frame, "dtype", "")))
    if isinstance(frame, (bytes, bytearray, memoryview)):
        size = _encoded_size(bytes(frame))
        return ("encoded", size) if size is not None else ("encoded", "unreadable", len(frame))
    size = getattr(frame, "size", None)  # a PIL image
    return ("image", tuple(size) if size is not None else None, getattr(frame, "mode", None))


def _encoded_size(data: bytes) -> tuple | None:
    """(width, height, format) from an encoded frame's header, without decoding its pixels."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            return (*im.size, im.format)
    except Exception:  # not an image Pillow reads: the door refuses those anyway
        return None


def kind_of(request) -> str:
    """The request's fields that can make a step fail on their own (no prompt, no pixels)."""
    sampling = request.sampling
    fields = (request.adapter, request.task, request.output_mode,
              dataclasses.astuple(sampling) if dataclasses.is_dataclass(sampling) else sampling,
              request.app, request.slo_ms, request.priority, request.video is not None,
              tuple(_frame_sig(f) for f in _frames(request)))
    return "kind:" + repr(fields)  # repr: NaN equals itself here, where NaN != NaN in a tuple compare


def content_of(request) -> str:
    """The request's kind plus a hash of everything it carries (prompt, messages, token ids, frames)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((request.prompt, request.messages, request.raw_prompt, request.prompt_token_ids)).encode(
        "utf-8", "surrogatepass"))
    for frame in _frames(request):
        if isinstance(frame, np.ndarray):
            h.update(np.ascontiguousarray(frame).data)
        elif isinstance(frame, (bytes, bytearray, memoryview)):
            h.update(frame)
        elif hasattr(frame, "tobytes"):  # PIL
            h.update(frame.tobytes())
        else:
            h.update(repr(frame).encode())
    return "content:" + kind_of(request) + h.hexdigest()


def _black(frame: Any) -> Any:
    if isinstance(frame, np.ndarray):
        return np.zeros_like(frame)
    if isinstance(frame, (bytes, bytearray, memoryview)):
        from PIL import Image

        size = _encoded_size(bytes(frame))
        if size is None:
            return bytes(frame)
        w, h, fmt = size
        out = io.BytesIO()
        Image.new("RGB", (w, h)).save(out, format=fmt or "PNG")
        return out.getvalue()
    if hasattr(frame, "size") and hasattr(frame, "mode"):  # PIL
        from PIL import Image

        return Image.new(frame.mode, frame.size)
    return frame


def neutral_probe(request, request_id: str):
    """`request` with a neutral prompt and black frames of the same sizes (its fields unchanged)."""
    video = request.video
    if video is not None:
        video = [_black(f) for f in video] if isinstance(video, (list, tuple)) else _black(video)
    return dataclasses.replace(request, prompt=NEUTRAL_PROMPT, messages=None, raw_prompt=False,
                               prompt_token_ids=None, images=[_black(f) for f in request.images], video=video,
                               request_id=request_id)


def describe(request) -> str:
    """The fields of a refused kind, for the refusal's message (the client's own values only)."""
    s = request.sampling
    parts = [f"adapter={request.adapter!r}", f"output_mode={request.output_mode!r}",
             f"frames={len(_frames(request))}"]
    if request.task is not None:
        parts.append(f"task={request.task!r}")
    if dataclasses.is_dataclass(s):
        parts.append("sampling=" + ", ".join(f"{f.name}={getattr(s, f.name)!r}" for f in dataclasses.fields(s)
                                              if getattr(s, f.name) != f.default))
    if request.slo_ms is not None:
        parts.append(f"slo_ms={request.slo_ms!r}")
    return "; ".join(parts)


class Culprits:
    """A bounded LRU of failure fingerprints (kinds and exact contents)."""

    def __init__(self, max_kinds: int = MAX_KINDS):
        self.max_kinds = max_kinds
        self._seen: OrderedDict[str, str] = OrderedDict()  # fingerprint -> why it is refused
        self._contents = 0  # content fingerprints held: the door hashes frames only while there are some
        self._lock = threading.Lock()
        # called with (fingerprint, why) after each record: an engine in another process tells the
        # front end, whose copy (`learn`) refuses such requests before they are even prepared
        self.on_record = None

    def __len__(self) -> int:
        return len(self._seen)

    def record(self, request, by_kind: bool, failure: str) -> str:
        """Remembers a failed request's kind (by_kind) or its exact content; returns the fingerprint."""
        key = kind_of(request) if by_kind else content_of(request)
        what = (f"requests with these settings ({clip(describe(request), 300)})" if by_kind
                else "this exact request (the same prompt and frames)")
        why = f"the engine failed on {what} ({failure}) and refuses them; change them to be served"
        self.learn(key, why)
        if self.on_record is not None:
            self.on_record(key, why)
        return key

    def learn(self, key: str, why: str) -> None:
        """Holds a fingerprint (record's, or one another Culprits recorded: the engine's, in another process)."""
        with self._lock:
            if key not in self._seen:
                self._contents += key.startswith("content:")
            self._seen[key] = why
            self._seen.move_to_end(key)
            while len(self._seen) > self.max_kinds:
                old, _ = self._seen.popitem(last=False)
                self._contents -= old.startswith("content:")

    def refuses(self, request) -> str | None:
        """Why `request` is refused, or None. Costs one repr while only kinds are held."""
        if not self._seen:
            return None
        keys = [kind_of(request)]
        if self._contents:
            keys.append(content_of(request))
        with self._lock:
            for key in keys:
                if key in self._seen:
                    self._seen.move_to_end(key)
                    return self._seen[key]
        return None
