"""Errors of the HTTP front end as OpenAI-style JSON bodies with their status codes.

A client's mistake reaches it as the RPyC service's own error kind (serve.rpc.replies: a short
server-chosen name and a message already clipped, never internals), given the status an OpenAI
client expects:

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": "bad_frame"}}
"""

from __future__ import annotations

from serve.rpc.logs import clip
from serve.rpc.replies import MAX_ERROR_CHARS

# the service's error kinds (serve.rpc.wire, state, ownership, adapter_calls) -> HTTP status
STATUS = {
    "bad_argument": 400, "bad_frame": 400, "rejected": 400, "unsupported": 400, "unknown_request": 404,
    "unauthorized": 401, "forbidden": 403, "unknown_adapter": 404, "not_found": 404, "expired": 404,
    "method_not_allowed": 405, "timeout": 408, "too_large": 413, "unsupported_media": 415,
    "too_many_requests": 429, "too_many_adapters": 429,
    "busy": 503, "engine_error": 503, "warming": 503, "internal": 500,
}
# the `type` field OpenAI's clients read, by status
OPENAI_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable_error"}


class HttpError(Exception):
    """A refusal answered to this request alone: `kind` is one of STATUS's keys."""

    def __init__(self, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.kind, self.param = kind, param

    @property
    def status(self) -> int:
        return STATUS.get(self.kind, 400)

    def body(self) -> dict:
        return error_body(self.kind, str(self), self.param)


def error_body(kind: str, message: str, param: str | None = None) -> dict:
    status = STATUS.get(kind, 400)
    return {"error": {"message": clip(str(message), MAX_ERROR_CHARS), "type": OPENAI_TYPE[status],
                      "param": param, "code": kind}}


def from_reply(reply: dict) -> HttpError:
    """The HttpError of a service reply `{"ok": false, "error": {"type", "message"}}`."""
    error = reply.get("error") or {}
    return HttpError(str(error.get("type", "internal")), str(error.get("message", "")))
