"""The one exception type that carries a client's mistake to that client (serve.rpc.wire re-exports it)."""

from __future__ import annotations


class RequestError(ValueError):
    """Bad input from a client: answered to that client, never fatal to the server."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind  # a stable machine-readable reason: "bad_frame", "too_large", ...

    def to_dict(self) -> dict[str, str]:
        return {"type": self.kind, "message": str(self)}
