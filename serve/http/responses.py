"""OpenAI response objects from the service's events, and stop strings cut out of the text.

The events are the RPyC poll's: `tokens` ({"text": delta}) while a request decodes, then `final`
(full text, token ids, finish_reason, timing, and `head` for a head answer) or `error`.
"""

from __future__ import annotations

import json
import time
import uuid

from .errors import HttpError


class Choice:
    """One choice's text as it streams, with the earliest stop string cut off (and nothing after it sent).
    Holds back the last characters that could still begin a stop string."""

    def __init__(self, index: int, stops: tuple[str, ...]):
        self.index, self.stops = index, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.sent = "", 0
        self.stopped = False  # a stop string matched: the request is aborted, its text ends there
        self.final: dict | None = None

    def feed(self, delta: str) -> str:
        """Takes a delta; returns the text that may be sent now."""
        if self.stopped or not delta:
            return ""
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True
            return self.flush()
        upto = max(self.sent, len(self.text) - self.hold) if self.stops else len(self.text)
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def take(self, event: dict) -> str:
        """One event; returns the text it adds that may be sent now. An error event raises its HttpError."""
        if event["type"] == "error":
            error = event.get("error") or {}
            raise HttpError(str(error.get("type", "engine_error")), str(error.get("message", "")))
        if event["type"] == "tokens":
            return self.feed(event.get("text") or "")
        if event["type"] == "final":
            self.final = event
            out = self.feed(event.get("new_text") or "")
            if not self.text and not self.stopped and event.get("text"):  # no deltas (a client without detokenize)
                out += self.feed(event["text"])
            return out + ("" if self.stopped else self.flush())
        return ""

    @property
    def done(self) -> bool:
        return self.final is not None or self.stopped

    @property
    def finish_reason(self) -> str:
        if self.stopped:
            return "stop"
        reason = (self.final or {}).get("finish_reason")
        return "length" if reason == "length" else "stop"

    @property
    def head(self) -> dict | None:
        return (self.final or {}).get("head")

    def content(self) -> str:
        """The text a client without the extension reads: the decoded text, else the head's answer."""
        return self.text or head_text(self.head)


def head_text(head: dict | None) -> str:
    if not head:
        return ""
    for key in ("answer", "label", "count"):
        if head.get(key) is not None:
            return str(head[key])
    if head.get("boxes") is not None:
        return json.dumps(head["boxes"])
    return ""


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(choices: list[Choice]) -> dict:
    prompt = max((c.final or {}).get("timing", {}).get("prompt_tokens") or 0 for c in choices)
    completion = sum(len((c.final or {}).get("token_ids") or ()) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def whole(chat: bool, rid: str, model: str, choices: list[Choice], head: bool) -> dict:
    """The non-streaming response."""
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [_choice(chat, c) for c in choices], "usage": usage(choices)}
    # the server's own timing of the first choice, as the RPyC final event has it (frame decoding,
    # preprocessing, queue, prefill, decode, prompt tokens)
    body["vlora"] = {"timing": (choices[0].final or {}).get("timing")}
    if head:
        body["vlora"].update(heads=[c.head for c in choices], head=choices[0].head)
    return body


def _choice(chat: bool, c: Choice) -> dict:
    if chat:
        return {"index": c.index, "message": {"role": "assistant", "content": c.content()},
                "finish_reason": c.finish_reason, "logprobs": None}
    return {"index": c.index, "text": c.content(), "finish_reason": c.finish_reason, "logprobs": None}


def chunk(chat: bool, rid: str, model: str, created: int, index: int, text: str | None,
          finish: str | None = None, first: bool = False, head: dict | None = None) -> dict:
    """One streamed chunk of choice `index`."""
    if chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
    body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}
    if head is not None:
        body["vlora"] = {"index": index, "head": head}
    return body


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
