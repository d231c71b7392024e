"""The address file of a running `vlora serve`: how the apps find the server a user started.

`vlora serve` writes ${paths.home}/server.json once it accepts connections and removes it on a clean
shutdown (SIGINT / SIGTERM):

    {"host": "127.0.0.1", "port": 18861, "pid": 4242, "started": "2026-11-27T20:31:07Z"}

The token is never written here: a client brings its own (VLORA_TOKEN). A file left by a server
that was killed is stale: its pid is gone, or its port refuses connections; `find_server` ignores
it with a one-line note, and the next `vlora serve` writes over it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

FILE_NAME = "server.json"
# a server listening on every interface is reached on the loopback of this machine
_ANY_HOST = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


@dataclass(frozen=True)
class ServerAddress:
    host: str  # as a client connects to it (a wildcard bind becomes the loopback)
    port: int
    pid: int
    started: str
    path: Path  # the file it was read from

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def address_path(home: str | os.PathLike) -> Path:
    return Path(home) / FILE_NAME


def write_address(home: str | os.PathLike, host: str, port: int) -> Path:
    """Writes this process's address file (atomically: a reader never sees half of it)."""
    path = address_path(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"host": host, "port": int(port), "pid": os.getpid(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = path.with_name(f".{FILE_NAME}.{os.getpid()}")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(path)
    return path


def remove_address(path: Path | None, port: int | None = None) -> None:
    """Removes the address file if it is still this process's (a later server may have replaced it)."""
    if path is None:
        return
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if record.get("pid") == os.getpid() and (port is None or record.get("port") == port):
        path.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _port_answers(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def read_address(path: Path) -> ServerAddress:
    """The address a file records; ValueError naming the file when it is not one."""
    try:
        record = json.loads(path.read_text())
        host = str(record["host"])
        return ServerAddress(_ANY_HOST.get(host, host), int(record["port"]), int(record["pid"]),
                             str(record.get("started", "?")), path)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a server address file ({type(e).__name__}: {e})") from None


def find_server(home: str | os.PathLike, log=None, who: str = "vlora") -> ServerAddress | None:
    """The running server whose address file is in `home`, or None (no file, or a stale one: a
    one-line note on `log` says why it was ignored)."""
    log = log or sys.stderr
    path = address_path(home)
    if not path.is_file():
        return None
    try:
        found = read_address(path)
    except (OSError, ValueError) as e:
        print(f"{who}: ignoring {e}", file=log, flush=True)
        return None
    if not _pid_alive(found.pid):
        why = f"its server (pid {found.pid}) is gone"
    elif not _port_answers(found.host, found.port):
        why = f"nothing answers at {found} (pid {found.pid})"
    else:
        return found
    print(f"{who}: ignoring the stale server address file {path}: {why}", file=log, flush=True)
    return None
