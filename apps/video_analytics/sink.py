"""Results as JSON lines: one line per (chunk, task) result and one per stream event.

    {"type": "result", "stream": "cam0", "chunk": 3, "task": "count", "prediction": {...},
     "truth": 2, "score": {"correct": true}, "latency_ms": 41.2, "route": {...}, ...}
    {"type": "event", "stream": "cam1", "event": "reconnecting", "error": "...", ...}

Lines are flushed as they are written, so a reader (or `tail -f`) sees results live; many
streams share one sink.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class JsonlSink:
    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")
        self._lock = threading.Lock()
        self.lines = 0

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({"time": round(time.time(), 3), **record}, default=_plain)
        with self._lock:
            if self._file.closed:
                return  # a stream finishing after close(): its line has nowhere to go
            self._file.write(line + "\n")
            self._file.flush()
            self.lines += 1

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> "JsonlSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _plain(value: Any) -> Any:
    """numpy scalars and tuples of them, as JSON values."""
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
