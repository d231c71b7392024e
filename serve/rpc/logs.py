"""The server's log stays bounded whatever clients send: every record is clipped to a length, a
record repeated within a second is counted instead of written, and tracebacks are kept only for
the server's own failures (the engine, an internal error), never for a client's malformed input."""

from __future__ import annotations

import logging
import time

MAX_CHARS = 500  # of one record's message: a client's 100 kB string must not land in the log whole


def clip(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters, saying how much was cut."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


class BoundedRecords(logging.Filter):
    """Clips each record's message, and drops repeats of a message seen less than `every_s` ago
    (the next one written says how many were dropped)."""

    def __init__(self, max_chars: int = MAX_CHARS, every_s: float = 1.0):
        super().__init__()
        self.max_chars, self.every_s = max_chars, every_s
        self._last: dict[tuple, list] = {}  # (logger, level, template) -> [time, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg)[:100])
        now = time.monotonic()
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < self.every_s:
            seen[1] += 1
            return False
        dropped = seen[1] if seen is not None else 0
        if len(self._last) > 1024:  # a bounded memory of messages
            self._last.clear()
        self._last[key] = [now, 0]
        message = clip(record.getMessage(), self.max_chars)
        record.msg, record.args = (f"{message} ({dropped} like it dropped)" if dropped else message), None
        return True


def bound(*loggers: logging.Logger) -> None:
    """Installs the filter on `loggers` once."""
    for logger in loggers:
        if not any(isinstance(f, BoundedRecords) for f in logger.filters):
            logger.addFilter(BoundedRecords())
