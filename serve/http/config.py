"""The HTTP front end's settings (conf/serve.yaml `http:`), checked before anything is built, and the
one-line answer when its packages are missing."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

EXTRA = 'pip install -e ".[http]"'
PACKAGES = ("starlette", "uvicorn")
BASE64_SLACK = 1 << 20  # beyond the frames' base64 text: the JSON around them (prompt, fields)
SECONDS = ("body_timeout_s", "keep_alive_s", "first_byte_timeout_s", "header_timeout_s")


def missing_packages() -> str | None:
    """None when the HTTP front end can run here, else the one line that says what to install."""
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return f"http.port is set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed; " \
           f"{EXTRA} adds the HTTP front end"


@dataclass(frozen=True)
class HttpConfig:
    port: int | None = None  # None: off; 0: any free port
    host: str = "127.0.0.1"
    # image_url / video_url files are read only under this folder ("" : data URLs and frames only)
    media_root: str = ""
    max_body_bytes: int = 0  # 0: rpc.max_message_bytes in base64 (4/3) plus BASE64_SLACK
    body_timeout_s: float = 30.0  # the whole body within this after the headers; slower clients get 408
    max_concurrent: int = 256  # requests in progress at once, every client; more get 503
    max_n: int = 8  # choices of one request (each is a request of the engine)
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    # the door (serve/http/door.py): connections without a request in progress
    max_pending: int = 128  # in all, tenants' kept-alive ones too; past it the group holding the most gives one up
    max_pending_per_address: int = 16  # of one address before any token; past it the address gives up its own
    first_byte_timeout_s: float = 1.0  # a new connection's first byte within this
    header_timeout_s: float = 5.0  # a request's whole head within this of its first byte; slower: 408
    max_video_file_bytes: int = 256 << 20  # a video_url file's size on disk

    def __post_init__(self) -> None:
        if self.port is not None and (type(self.port) is not int or not 0 <= self.port <= 65535):
            raise ValueError(f"http.port={self.port!r}: an integer in [0, 65535] (0: any free port), or null: off")
        for name in ("max_concurrent", "max_n", "max_video_file_bytes", "max_pending", "max_pending_per_address"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"http.{name}={value!r}: must be an integer >= 1")
        if type(self.max_body_bytes) is not int or self.max_body_bytes < 0:
            raise ValueError(f"http.max_body_bytes={self.max_body_bytes!r}: an integer >= 0 (0: from rpc.max_message_bytes)")
        for name in SECONDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
                raise ValueError(f"http.{name}={value!r}: must be a positive number of seconds")
        if self.media_root and not Path(self.media_root).expanduser().is_dir():
            raise ValueError(f"http.media_root={self.media_root!r} is not a directory")

    @property
    def enabled(self) -> bool:
        return self.port is not None

    def body_limit(self, max_message_bytes: int) -> int:
        return self.max_body_bytes or (max_message_bytes + 2) // 3 * 4 + BASE64_SLACK

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "HttpConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"http.{unknown[0]} is not a setting; known: {sorted(known)}")
        if d.get("media_root") is None:
            d["media_root"] = ""
        for name in SECONDS:
            if type(d.get(name)) is int:
                d[name] = float(d[name])
        return cls(**d)
