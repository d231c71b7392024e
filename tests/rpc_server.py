"""A real `vlora serve` in a subprocess on loopback, for the RPC tests."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

TOKEN = "test-token-0123456789"


def flood_room(descriptors: int, alias: str) -> tuple[int, int]:
    """Readies this process for a socket flood from loopback address `alias` (127.0.0.x): the file
    descriptor limit raised to its hard limit, the alias checked. Skips the test when either falls
    short; returns the (soft, hard) limit to restore."""
    import resource
    import socket

    import pytest

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < descriptors:
        pytest.skip(f"the flood needs {descriptors} file descriptors; this process may open only {hard} (ulimit -Hn)")
    try:
        socket.create_connection(("127.0.0.1", 9), timeout=1, source_address=(alias, 0)).close()
    except ConnectionRefusedError:
        pass  # the alias exists, nothing listens on port 9
    except OSError as e:
        pytest.skip(f"loopback aliases ({alias}) are not usable here: {e}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, hard


def _live_parents() -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process."""
    parent = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != "Z":
            parent[int(pid)] = int(fields[1])
    return parent


def children(pid: int) -> set[int]:
    """The live child processes of `pid`."""
    return {child for child, parent in _live_parents().items() if parent == pid}


def _descendants(root: int) -> set[int]:
    parent = _live_parents()
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def follower_pids() -> set[int]:
    """Pids of tensor-parallel followers that a group leader started (serve.distributed.local_group) under
    this process: a test in another process (a pytest-xdist worker) may have groups of its own."""
    pids = set()
    for pid in _descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"local_group import _follow" in f.read():
                    pids.add(pid)
        except OSError:  # gone meanwhile
            pass
    return pids


class ServerProcess:
    def __init__(self, checkpoint, home, *overrides: str, launcher: tuple[str, ...] = (), max_open_files: int | None = None):
        """launcher: arguments of `python -m` that run the module (e.g. torchrun's) in front of vlora.cli;
        max_open_files: the server process's file-descriptor limit (RLIMIT_NOFILE)."""
        env = {**os.environ, "VLORA_HOME": str(home), "VLORA_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", *launcher, "vlora.cli", "serve", f"model.path={checkpoint}", "rpc.port=0",
               "engine.device=cpu", "+engine.num_kv_blocks=96", f"hydra.run.dir={home}/runs/serve", *overrides]
        def limit():
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))

        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     preexec_fn=limit if max_open_files else None)
        self.lines: list[str] = []
        self.port = None
        deadline = time.monotonic() + 120
        while self.port is None:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the server exited before listening:\n" + "".join(self.lines))
            self.lines.append(line)
            if line.startswith("vlora serve: listening on "):
                self.port = int(line.rsplit(":", 1)[1])
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not start in 120 s:\n" + "".join(self.lines))
        # keep draining its output so a chatty server never blocks on a full pipe
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def fail_sampling_when(monkeypatch, condition, message: str = "injected fault") -> None:
    """Makes the engine's sampler raise RuntimeError(message) for a step whose sampling params
    satisfy condition(params) (a list, one per sequence): a fault no validation can foresee."""
    import serve.engine.model_runner as runner

    real = runner.sample

    def faulty(logits, params, *args, **kwargs):
        if condition(params):
            raise RuntimeError(message)
        return real(logits, params, *args, **kwargs)

    monkeypatch.setattr(runner, "sample", faulty)
