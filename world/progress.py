"""A progress line that suits where it is written: rewritten in place on a terminal, whole lines in
a log file or a pipe.

    progress = ProgressLine(sys.stderr)
    for i, item in enumerate(items, 1):
        ...
        progress.update(f"distill people: {i}/{len(items)} images labelled")
    progress.end()   # a terminal's line ends; a log gets the last state if it was held back

On a terminal each update replaces the line (`\\r`), as a bar does. Anywhere else a `\\r` update
would pile every state into one huge line, so the first update is a line of its own, later ones
at most every `every_s` seconds, and `end()` writes the last one held back. The long commands'
loops (world rendering, distillation, teacher fitting, pretraining, training) all report through
it; it lives on the lowest floor because the world's rendering is the first of them.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

EVERY_S = 30.0  # a log's progress lines: at most one this often (the last state always)


def is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


class ProgressLine:
    def __init__(self, stream: TextIO | None = None, every_s: float = EVERY_S):
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = is_terminal(self.stream)
        self.every_s = every_s
        self._written_at: float | None = None  # when a log last got a line
        self._held: str | None = None          # an update not written yet (a log only)
        self._open = False                     # a terminal's line waits for its end

    def update(self, text: str) -> None:
        if self.terminal:
            self.stream.write(f"\r{text}")
            self.stream.flush()
            self._open = True
            return
        now = time.monotonic()
        if self._written_at is None or now - self._written_at >= self.every_s:
            self._line(text)
            self._written_at = now
        else:
            self._held = text

    def end(self, text: str | None = None) -> None:
        """Ends the progress (optionally with a final state): a terminal's line gets its newline,
        a log the last state it has not seen. Updates after it start a new line."""
        if text is not None:
            if self.terminal:
                self.update(text)
            else:
                self._held = text
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
        elif self._held is not None:
            self._line(self._held)
        self._held, self._open, self._written_at = None, False, None

    def _line(self, text: str) -> None:
        self._held = None
        self.stream.write(text + "\n")
        self.stream.flush()


__all__ = ["ProgressLine", "is_terminal", "EVERY_S"]
