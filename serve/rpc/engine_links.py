"""The engine process's links to its front ends: the pipe of the process that started it, and any
number of tenant front-end processes (serve/rpc/tenant_processes.py) that attach later through a
Unix socket of the engine process, each with its own sender and reader.

Why more than one front end: the connection threads of one front end take turns at one interpreter,
so a tenant's 32 connections calling in a loop slowed another tenant's requests 2-3 fold on a GPU
with the step loop in a process of its own (results/soak/nvidia_h200/tenant_order). With a front-end
process per tenant, a tenant's calls take only its own interpreter.

Every link gets the loop's events for the requests it added, answers to its calls, and what all
front ends must know: a request kind that made a step fail (("culprit", ...)), the warm-up's end
(("warm", report)), and that the adapters changed (("adapters",), after a load or unload through any
link). An attached link that closes (its process exited or died) has its requests aborted, so their
KV blocks and batch slots go back to the engine.

The socket lies in a directory only this user can enter, and a front end must also present the
link's random key (multiprocessing's authkey handshake) before it is read.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import shutil
import tempfile
import threading
from multiprocessing.connection import Listener
from operator import methodcaller

log = logging.getLogger("vlora.serve.rpc")
ADAPTER_CHANGES = ("load_adapter", "unload_adapter")


def changes_adapters(fn) -> bool:
    """Whether an engine call (a methodcaller, as the service makes them) loads or unloads an adapter."""
    return isinstance(fn, methodcaller) and fn.__reduce__()[1][0] in ADAPTER_CHANGES


class Link:
    """One front end: its outbox (written by its sender thread) and the requests it has in flight."""

    def __init__(self, name: str):
        self.name = name
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.live: set[str] = set()  # request ids added through this link and not finished
        self.lock = threading.Lock()

    def added(self, request_id: str) -> None:
        with self.lock:
            self.live.add(request_id)

    def finished(self, request_id: str) -> None:
        with self.lock:
            self.live.discard(request_id)

    def take_live(self) -> list[str]:
        with self.lock:
            live, self.live = list(self.live), set()
        return live


class Links:
    """All front ends of one engine process. `broadcast(message)` reaches every open link."""

    def __init__(self, primary: Link):
        self._links: list[Link] = [primary]
        self._lock = threading.Lock()
        self.warm_report: dict | None = None
        self._listener: Listener | None = None
        self._dir: str | None = None

    def broadcast(self, message: tuple) -> None:
        with self._lock:
            if message[0] == "warm":
                self.warm_report = message[1]
            links = list(self._links)
        for link in links:
            link.outbox.put(message)

    def remove(self, link: Link) -> None:
        with self._lock:
            if link in self._links:
                self._links.remove(link)

    # ---- attaching front ends ------------------------------------------------------------------
    def listen(self) -> tuple[str, bytes]:
        """Opens the socket front ends attach to; returns (address, key) for them."""
        self._dir = tempfile.mkdtemp(prefix="vlora-engine-")  # mode 0700: only this user enters it
        key = secrets.token_bytes(32)
        self._listener = Listener(os.path.join(self._dir, "engine.sock"), family="AF_UNIX", authkey=key)
        return self._listener.address, key

    def accept_forever(self, serve_link, ready_info: dict) -> None:
        """Accepts front ends until close(); each is served by serve_link(conn, link) on a thread of its own,
        after ("ready", info) (warming only while the engine still is) and, if the warm-up is over,
        ("warm", report)."""
        count = 0
        while self._listener is not None:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError) as e:  # a bad key, or the listener closed
                if self._listener is None:
                    return
                log.warning("engine process: a front end failed to attach (%s: %s)", type(e).__name__, e)
                continue
            count += 1
            link = Link(f"front end {count}")
            with self._lock:  # a broadcast after this reaches the link; one before it is in what it is told
                warm = self.warm_report
                link.outbox.put(("ready", dict(ready_info, warming=bool(ready_info.get("warming")) and warm is None)))
                if warm is not None:
                    link.outbox.put(("warm", warm))
                self._links.append(link)
            threading.Thread(target=serve_link, args=(conn, link), name=f"vlora-engine-{link.name}",
                             daemon=True).start()

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.close()
            except OSError:
                pass
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
