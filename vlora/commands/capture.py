"""A command's output captured to a log file, the console keeping only the lines it says.

    with CapturedOutput(out / "demo.log", verbose=False) as console:
        console.say("[demo 1/4] offline stage")   # the console (and the log)
        offline.run(cfg)                           # every other byte: the log only

The process's stdout and stderr file descriptors (1 and 2) go to a pipe while it is on, and
sys.stdout / sys.stderr write to them, so everything reaches the log whoever writes it: print,
logging handlers that took sys.stdout when their library was imported (ultralytics' training),
progress bars, C libraries and child processes. A thread writes what arrives to the log as a terminal would end up showing each line:
ANSI escape codes removed, a line rewritten by carriage returns kept at its last state (a
progress bar of a thousand updates is one line, not one line of a thousand states; one that runs
for minutes also leaves its state every PROGRESS_EVERY_S). verbose:
the console also gets every byte, as it came.

A command that is also a stage of another (`vlora offline` inside `vlora demo`) opens its capture
through `command_stages`: alone it captures to its own log; inside another capture its stage lines
and output go to that one, as before.

    with command_stages("offline", out / "offline.log", verbose) as say:
        say("[offline 1/3] teachers and distilled datasets")
"""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import sys
import threading
import time
from pathlib import Path

# CSI sequences (colours, erase line, cursor moves) and the two-byte escapes
ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")
TAIL_ON_ERROR = 20  # lines of the log shown on the console when the captured code raises
# a line rewritten by carriage returns for longer than this (a pretraining's step counter) also
# leaves its state in the log this often, so that a reader of the log sees it move
PROGRESS_EVERY_S = 30.0


def shown(text: str) -> str:
    """What a terminal leaves of one line: the last carriage-return part that holds anything once
    ANSI codes are removed (a bar ending in "\\r\\x1b[K" still leaves its last state)."""
    parts = [ANSI.sub("", p) for p in text.split("\r")]
    return next((p for p in reversed(parts) if p.strip()), "").rstrip()


class TerminalLines:
    """Bytes in, finished lines out (`shown` of each). The unfinished line is kept collapsed to its
    last state, so a bar that never ends a line costs one line of memory."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = ""

    def feed(self, data: bytes) -> list[str]:
        *done, rest = (self._pending + self._decoder.decode(data)).split("\n")
        if "\r" in rest:  # the raw tail stays: an escape code may be cut in two between reads
            head, tail = rest.rsplit("\r", 1)
            rest = f"{shown(head)}\r{tail}"
        self._pending = rest
        return [shown(line) for line in done]

    def progress(self) -> str:
        """The unfinished line as it shows now ("" when there is none)."""
        return shown(self._pending)

    def close(self) -> list[str]:
        last = shown(self._pending + self._decoder.decode(b"", final=True))
        self._pending = ""
        return [last] if last else []


class CapturedOutput:
    active = 0  # captures open in this process: a command run inside one writes to it

    def __init__(self, log_path: str | Path, verbose: bool = False, progress_every_s: float = PROGRESS_EVERY_S):
        self.log_path = Path(log_path)
        self.verbose = verbose
        self.progress_every_s = progress_every_s
        self._lock = threading.Lock()  # the pump and say() both write the log

    def __enter__(self) -> "CapturedOutput":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w", encoding="utf-8")
        _flush_std()
        self._saved = {fd: os.dup(fd) for fd in (1, 2)}
        self._console = self._saved[2]
        self._console_is_terminal = os.isatty(self._console)
        read_fd, write_fd = os.pipe()
        for fd in (1, 2):
            os.dup2(write_fd, fd)
        os.close(write_fd)  # fds 1 and 2 hold the write end now: the pump ends when they are restored
        self._read_fd = read_fd
        # Python-level writers too, where sys.stdout / sys.stderr are not fds 1 and 2 (a test
        # runner's capture, a notebook): line-buffered, so the log keeps the order of writes
        self._streams = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = (open(fd, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
                                  for fd in (1, 2))
        self._pump = threading.Thread(target=self._pump_lines, name="captured-output", daemon=True)
        self._pump.start()
        CapturedOutput.active += 1
        return self

    def say(self, line: str) -> None:
        """One line to the console and the log. It goes to the log through the pipe, after what
        was written before it (the pump tees it to the console when verbose)."""
        _flush_std()
        data = (line + "\n").encode()
        if not self.verbose:
            _write_all(self._console, data)
        _write_all(2, data)

    def __exit__(self, exc_type, exc, tb) -> None:
        CapturedOutput.active -= 1
        _flush_std()
        ours, (sys.stdout, sys.stderr) = (sys.stdout, sys.stderr), self._streams
        for stream in ours:
            stream.close()  # closefd=False: fds 1 and 2 stay open
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
        # a child process that outlived the run may still hold the pipe: then its pump is left running
        self._pump.join(timeout=10)
        if not self._pump.is_alive():
            os.close(self._read_fd)
        if exc_type is not None and not self.verbose:  # the cause of a failure is in the log: show its end
            with self._lock:
                self._log.flush()
            tail = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-TAIL_ON_ERROR:]
            print(f"--- the last {len(tail)} lines of {self.log_path} ---", *tail, sep="\n", file=sys.stderr,
                  flush=True)
        with self._lock:
            self._log.close()
        for saved in self._saved.values():
            os.close(saved)

    def _pump_lines(self) -> None:
        lines = TerminalLines()
        last = time.monotonic()  # when the log last got a line
        while True:
            data = os.read(self._read_fd, 65536)
            if not data:
                break
            if self.verbose and self._console_is_terminal:
                _write_all(self._console, data)
            done = lines.feed(data)
            if not done and time.monotonic() - last >= self.progress_every_s:
                done = [lines.progress()] if lines.progress() else []
            if done:
                self._write(done)
                last = time.monotonic()
        self._write(lines.close())

    def _tee_lines(self, lines: list[str]) -> None:
        """verbose, to a console that is a file or a pipe: the log's clean lines, not the raw bytes"""
        if self.verbose and not self._console_is_terminal and lines:
            try:
                _write_all(self._console, "".join(line + "\n" for line in lines).encode())
            except OSError:
                pass

    def _write(self, lines: list[str]) -> None:
        if not lines:
            return
        self._tee_lines(lines)
        with self._lock:
            try:
                self._log.write("".join(line + "\n" for line in lines))
                self._log.flush()  # a user may follow the log while the run goes on
            except (OSError, ValueError):  # a full disk or a closed log must not stop the pump: writers would block
                pass


@contextlib.contextmanager
def command_stages(name: str, log_path: str | Path, verbose: bool = False):
    """say(line) for a command's stage lines (see the module docstring): alone, the command's
    output goes to `log_path` and the console gets the stage lines (verbose: everything too)."""
    if CapturedOutput.active:
        yield lambda line: print(line, file=sys.stderr, flush=True)
        return
    with CapturedOutput(log_path, verbose=verbose) as captured:
        captured.say(f"[{name}] output of every stage: {log_path}")
        yield captured.say


class StderrLines:
    """While on, and only where stderr is not a terminal (a log file, a pipe): what reaches file
    descriptor 2 (progress bars of torch, transformers or ultralytics, child processes) arrives
    there as the lines a terminal would end up showing, a line rewritten by carriage returns at
    most every `every_s` seconds, instead of one huge line of every state. On a terminal, or
    inside a capture (which cleans its log the same way), it does nothing.

        with StderrLines():
            hydra_entry("distill", run)()
    """

    def __init__(self, every_s: float = PROGRESS_EVERY_S):
        self.every_s = every_s
        self.on = False

    def __enter__(self) -> "StderrLines":
        if CapturedOutput.active or os.isatty(2):
            return self
        _flush_std()
        self._saved = os.dup(2)
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._read_fd, self.on = read_fd, True
        self._pump = threading.Thread(target=self._pump_lines, name="stderr-lines", daemon=True)
        self._pump.start()
        return self

    def __exit__(self, *exc) -> None:
        if not self.on:
            return
        _flush_std()
        os.dup2(self._saved, 2)  # the pump ends at the pipe's end (a child that outlived the run may hold it)
        self._pump.join(timeout=10)
        if not self._pump.is_alive():
            os.close(self._read_fd)
            os.close(self._saved)
        self.on = False

    def _pump_lines(self) -> None:
        lines, last = TerminalLines(), time.monotonic()
        while True:
            data = os.read(self._read_fd, 65536)
            if not data:
                break
            done = lines.feed(data)
            if not done and lines.progress() and time.monotonic() - last >= self.every_s:
                done = [lines.progress()]
            if done:
                self._out(done)
                last = time.monotonic()
        self._out(lines.close())

    def _out(self, done: list[str]) -> None:
        try:
            _write_all(self._saved, "".join(line + "\n" for line in done).encode())
        except OSError:
            pass  # stderr's file went away: writers must not block on a full pipe


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]
