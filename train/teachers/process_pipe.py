"""The parent's end of a process teacher's worker: the process, its pipes, and one message out and
one back within a deadline (the protocol: process_worker.py). Errors name the interpreter, what
the worker was asked and the end of its stderr."""
from __future__ import annotations

import collections
import fcntl
import json
import os
import select
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from .base import TeacherError
from .process_worker import HEADER, message_parts, payload_sizes

WORKER = Path(__file__).with_name("process_worker.py")
STDERR_TAIL = 30  # lines of the worker's stderr an error shows
PIPE_BYTES = 1 << 20  # the pipes' buffer (Linux's default limit for one process): 64 KiB by default


class ProcessTeacherError(TeacherError):
    """The teacher's worker could not start, died, timed out or broke the protocol."""


class Worker:
    """The worker process and its two pipes: one message out, one back, within a deadline."""

    def __init__(self, python: str, path: list[str], what: str):
        self.python, self.what = python, what
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
        if path:  # this environment's PYTHONPATH belongs to it; the worker gets the teacher's folders only
            env["PYTHONPATH"] = os.pathsep.join(path)
        try:
            self.proc = subprocess.Popen([python, "-u", str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env=env, start_new_session=True)
        except OSError as e:
            raise ProcessTeacherError(f"{what}: cannot start {python}: {e}") from None
        self.tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
        self.lock = threading.Lock()  # one message in flight: distillation may call from several threads
        self.failed: str | None = None
        threading.Thread(target=self._read_stderr, name="teacher-worker-stderr", daemon=True).start()
        os.set_blocking(self.proc.stdin.fileno(), False)
        for pipe in (self.proc.stdin, self.proc.stdout):  # frames are megabytes: fewer, larger writes
            try:
                fcntl.fcntl(pipe.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
            except OSError:
                pass  # not Linux, or above the system's limit: the default size works, more slowly

    def _read_stderr(self) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            self.tail.append(raw.decode("utf-8", "replace").rstrip())

    def ask(self, header: dict, arrays: Sequence[np.ndarray], timeout_s: float, doing: str) -> tuple[dict, list]:
        with self.lock:
            if self.failed:
                raise ProcessTeacherError(self.failed)
            deadline = time.monotonic() + timeout_s
            try:
                self._send(message_parts(header, arrays), deadline)
                head = json.loads(self._recv(self._recv(HEADER.size, deadline, True), deadline))
                arrays = [np.frombuffer(self._recv(n, deadline), dtype=a["dtype"]).reshape(a["shape"])
                          for a, n in zip(head.get("arrays", []), payload_sizes(head))]
            except (TimeoutError, EOFError, BrokenPipeError, ValueError) as e:
                self.failed = self._failure(e, doing, timeout_s)
                raise ProcessTeacherError(self.failed) from None
            return head, arrays

    def _failure(self, e: Exception, doing: str, timeout_s: float) -> str:
        if isinstance(e, TimeoutError):
            self.kill()
            why = f"did not answer {doing} within {timeout_s:g} s (teachers: process.timeout_s); it was stopped"
        elif isinstance(e, ValueError):
            self.kill()
            why = f"broke the frame protocol during {doing} ({e}); a teacher must not write to the protocol's stdout"
        else:
            code = self._wait(5.0)
            why = f"died during {doing} (exit status {code})"
        time.sleep(0.05)  # the stderr reader's last lines
        tail = "\n".join(f"  | {line}" for line in self.tail) or "  | (nothing)"
        return f"{self.what} in {self.python}: the worker {why}; its stderr ends:\n{tail}"

    def _send(self, parts: list, deadline: float) -> None:
        fd = self.proc.stdin.fileno()
        for part in parts:
            view = memoryview(part)
            while view:
                if not select.select([], [fd], [], max(0.0, deadline - time.monotonic()))[1]:
                    raise TimeoutError
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    continue

    def _recv(self, n: int, deadline: float, header: bool = False):
        fd, chunks, left = self.proc.stdout.fileno(), [], n
        while left:
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError
            data = os.read(fd, min(left, 1 << 20))
            if not data:
                raise EOFError
            chunks.append(data)
            left -= len(data)
        data = b"".join(chunks)
        return HEADER.unpack(data)[0] if header else data

    def _wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: children of the teacher too
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None and not self.failed:
            try:
                with self.lock:
                    self._send(message_parts({"op": "bye"}), time.monotonic() + 5.0)
            except (TimeoutError, OSError):
                pass
            self._wait(5.0)
        self.kill()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                pipe.close()
            except OSError:
                pass
