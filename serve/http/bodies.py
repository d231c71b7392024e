"""OpenAI request bodies -> what the RPyC wire takes: one request spec (serve.rpc.wire), its frames,
and what the HTTP side does itself (n, stop strings, streaming).

Sampling fields go into the spec's `sampling` untouched, so the wire checks them exactly as for an
RPyC client (types, bounds, rpc.max_new_tokens). The engine takes one prompt: messages are
flattened into it (a lone user message, after any system text, is the prompt as written; a
conversation becomes `Role: text` lines). The `vlora` field is the extension (docs/http.md):
`{"output": "head", "task": "count"}` asks for the adapter's task head's answer; `app`, `slo_ms` and
`video_frames` are the RPyC request's own fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from serve.rpc.wire import ADAPTER_NAME, Limits

from .config import HttpConfig
from .errors import HttpError
from .media import Media

SAMPLING = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "max_tokens": "max_tokens",
            "max_completion_tokens": "max_tokens", "top_k": "top_k", "stop_token_ids": "stop_token_ids",
            "ignore_eos": "ignore_eos"}
# accepted only at the value that changes nothing (a client library may send them)
NEUTRAL = {"presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "logprobs": (False, None),
           "echo": (False, None), "best_of": (1, None), "suffix": (None,), "logit_bias": (None,),
           "tools": (None,), "tool_choice": (None, "none"), "response_format": (None,)}
COMMON = {"model", "n", "stop", "stream", "stream_options", "vlora", "user", *SAMPLING, *NEUTRAL}
ROLES = ("system", "developer", "user", "assistant")
VLORA_KEYS = {"output": (str,), "task": (str,), "app": (str,), "slo_ms": (int, float), "video_frames": (int,)}
MAX_STOP, MAX_STOP_CHARS, MAX_MESSAGES = 4, 256, 256


@dataclass
class Job:
    """One HTTP request as the service will run it: `n` submissions of `spec` with these frames."""

    model: str
    adapter: str | None
    spec: dict[str, Any]
    kind: str = "image"
    specs: list[dict] = field(default_factory=list)
    blobs: list[bytes] = field(default_factory=list)
    n: int = 1
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False

    @property
    def head(self) -> bool:
        return self.spec.get("output_mode") == "head"

    def spec_json(self, index: int) -> str:
        """The wire spec of choice `index` (a seeded request of n > 1 gets seed + index: n distinct samples)."""
        spec = dict(self.spec, frames=self.specs)
        seed = spec.get("sampling", {}).get("seed")
        if index and type(seed) is int:
            spec["sampling"] = dict(spec["sampling"], seed=seed + index)
        return json.dumps(spec)


def read_json(body: bytes) -> dict:
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise HttpError("bad_argument", "the body is not UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise HttpError("bad_argument", f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise HttpError("bad_argument", "the body is nested too deeply") from None
    except ValueError as e:  # NaN, Infinity, an integer of more than 4,300 digits
        raise HttpError("bad_argument", f"the body holds a number out of range ({str(e)[:100]})") from None
    if not isinstance(data, dict):
        raise HttpError("bad_argument", f"the body must be a JSON object, got {type(data).__name__}")
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a finite number")


def parse_chat(data: dict, limits: Limits, config: HttpConfig, base_model: str, check=None) -> Job:
    """check(job): called once the fields are read and before any picture is (the model's availability)."""
    job = _common(data, {"messages"}, base_model, config)
    if check is not None:
        check(job)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise HttpError("bad_argument", f"messages must be a list of 1 to {MAX_MESSAGES} messages", "messages")
    media = Media(limits, config.media_root, config.max_video_file_bytes)
    video_frames = job.spec.pop("video_frames", None)
    turns = [_message(m, i, media, video_frames) for i, m in enumerate(messages)]
    system = [text for role, text in turns if role in ("system", "developer") and text]
    rest = [(role, text) for role, text in turns if role not in ("system", "developer")]
    if len(rest) == 1 and rest[0][0] == "user":
        job.spec["prompt"] = "\n\n".join(system + [rest[0][1]])
    else:
        job.spec["prompt"] = "\n".join([*system, *(f"{role.capitalize()}: {text}" for role, text in rest)])
    job.kind, job.specs, job.blobs = media.kind, media.specs, media.blobs
    return job


def parse_completion(data: dict, limits: Limits, config: HttpConfig, base_model: str, check=None) -> Job:
    job = _common(data, {"prompt"}, base_model, config)
    if check is not None:
        check(job)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise HttpError("bad_argument", "prompt must be a string (or a list of one string)", "prompt")
    job.spec.pop("video_frames", None)
    job.spec["prompt"] = prompt
    return job


def _common(data: dict, own: set[str], base_model: str, config: HttpConfig) -> Job:
    unknown = sorted(set(data) - COMMON - own)
    if unknown:
        raise HttpError("bad_argument", f"unknown field {unknown[0][:64]!r}; see docs/http.md for the fields taken",
                        unknown[0][:64])
    for key, neutral in NEUTRAL.items():
        if key in data and not any(data[key] == v and type(data[key]) is type(v) for v in neutral):
            raise HttpError("bad_argument", f"{key} is not supported here (leave it out)", key)
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise HttpError("bad_argument", "model must name the base model or an adapter (GET /v1/models)", "model")
    if model != base_model and not ADAPTER_NAME.fullmatch(model):
        raise HttpError("unknown_adapter", f"no model {model[:64]!r}: GET /v1/models lists the base model and the "
                                           "adapters this key may use", "model")
    spec: dict[str, Any] = {} if model == base_model else {"adapter": model}
    sampling = {SAMPLING[k]: v for k, v in data.items() if k in SAMPLING and v is not None}
    if sampling:
        spec["sampling"] = sampling
    n = data.get("n", 1)
    if n is None:
        n = 1
    if type(n) is not int or not 1 <= n <= config.max_n:
        raise HttpError("bad_argument", f"n must be an integer in [1, {config.max_n}] (http.max_n)", "n")
    stream = data.get("stream", False)
    if stream is not None and type(stream) is not bool:
        raise HttpError("bad_argument", "stream must be true or false", "stream")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} or \
            type(options.get("include_usage", False)) is not bool:
        raise HttpError("bad_argument", "stream_options takes {\"include_usage\": true|false}", "stream_options")
    _vlora(data.get("vlora"), spec)
    return Job(model, None if model == base_model else model, spec, n=n, stop=_stop(data.get("stop")),
               stream=bool(stream), include_usage=bool(options.get("include_usage", False)))


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or \
            not all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_CHARS for s in stops):
        raise HttpError("bad_argument", f"stop must be a string or a list of at most {MAX_STOP} strings of 1 to "
                                        f"{MAX_STOP_CHARS} characters", "stop")
    for s in stops:
        _utf8(s, "stop")
    return tuple(stops)


def _vlora(extension, spec: dict) -> None:
    if extension is None:
        return
    if not isinstance(extension, dict):
        raise HttpError("bad_argument", "vlora must be an object, e.g. {\"output\": \"head\", \"task\": \"count\"}", "vlora")
    for key, value in extension.items():
        if key not in VLORA_KEYS:
            raise HttpError("bad_argument", f"unknown vlora field {str(key)[:64]!r}; known: {sorted(VLORA_KEYS)}", "vlora")
        if value is None:
            continue
        if type(value) not in VLORA_KEYS[key]:
            raise HttpError("bad_argument", f"vlora.{key} must be a {VLORA_KEYS[key][0].__name__}", "vlora")
        if key == "output":
            if value not in ("text", "head"):
                raise HttpError("bad_argument", "vlora.output must be 'text' or 'head'", "vlora")
            spec["output_mode"] = "head" if value == "head" else "generate"
        elif key == "video_frames":
            if value < 1:
                raise HttpError("bad_argument", "vlora.video_frames must be >= 1", "vlora")
            spec["video_frames"] = value
        else:
            spec[key] = value  # task, app, slo_ms: the wire checks them


def _utf8(text: str, name: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HttpError("bad_argument", f"{name} is not valid Unicode text (a lone surrogate at character "
                                        f"{e.start})", name) from None


def _message(message, index: int, media: Media, video_frames) -> tuple[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise HttpError("bad_argument", f"{where} must be an object with a role of {ROLES}", "messages")
    role, content = message["role"], message.get("content")
    if content is None and role == "assistant":
        return role, ""
    if isinstance(content, str):
        return role, content
    if not isinstance(content, list):
        raise HttpError("bad_argument", f"{where}.content must be a string or a list of parts", "messages")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif role != "user" and kind in ("image_url", "video", "video_url"):
            raise HttpError("bad_argument", f"{at}: pictures come in user messages", "messages")
        elif kind == "image_url":
            media.image(part.get("image_url"), at)
        elif kind == "video":
            media.video_frames(part.get("video"), at)
        elif kind == "video_url":
            url = part.get("video_url")
            media.video_file(url.get("url") if isinstance(url, dict) else url, at, video_frames)
        else:
            raise HttpError("bad_argument", f"{at}: a part is text, image_url, video (a list of frames) or video_url",
                            "messages")
    return role, "\n".join(texts)
