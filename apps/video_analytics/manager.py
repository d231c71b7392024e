"""Many streams at once, added and removed while the others run.

    manager = StreamManager(lambda: Client(host, port, token), manifest=read_manifest(path), sink=JsonlSink(p))
    manager.add(stream_from_dict({...}))          # starts at once
    manager.snapshot()                            # live metrics of every stream
    manager.remove("cam1")                        # stops it; its final metrics stay in the report
    manager.wait(timeout=30); manager.close()

Each stream gets its own client connection (`connect()`), so one stream's slow or failing
requests never hold up another's, and its own routes: the manifest's adapter for each task,
narrowed to what the server serves (routing.py). A stream whose frames differ in size from what
its tasks' domains were distilled at gets one warning line per task (resolution.py), kept in
`runner.warnings`, its snapshot and an event of the sink.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from apps.common.routing import Route, ServerCaps, resolve_route

from .config import StreamConfig
from .resolution import resolution_warnings
from .stream import StreamRunner


class StreamManager:
    def __init__(self, connect: Callable[[], Any], manifest: dict[str, Any] | None = None, sink=None,
                 heads: str = "auto", load_adapters: bool = False, datasets_dir: str | None = None):
        """datasets_dir: where domain datasets are looked for when an adapter's meta.json does not
        record its domains' datasets (for the resolution check)."""
        self.connect, self.manifest, self.sink = connect, manifest, sink
        self.datasets_dir = datasets_dir
        self.heads, self.load_adapters = heads, load_adapters
        self._streams: dict[str, StreamRunner] = {}
        self._removed: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def routes_for(self, config: StreamConfig, client) -> dict[str, Route]:
        try:
            caps = ServerCaps.probe(client)
        except Exception:  # an older server without list_adapters: assume the base model only
            caps = ServerCaps()
        load = client.load_adapter if self.load_adapters else None
        return {t.label: resolve_route(t.key, t.accuracy_target, self.manifest, caps, self.heads, load, t.question())
                for t in config.tasks}

    def add(self, config: StreamConfig) -> StreamRunner:
        with self._lock:
            if config.name in self._streams:
                raise ValueError(f"a stream named {config.name!r} is running already; "
                                 f"running: {sorted(self._streams)}")
        client = self.connect()
        try:
            runner = StreamRunner(config, client, self.routes_for(config, client), self.sink)
        except BaseException:
            client.close()
            raise
        with self._lock:
            self._streams[config.name] = runner
            self._removed.pop(config.name, None)
        runner.event("added", source=str(config.source), routes={k: r.to_dict() for k, r in runner.routes.items()})
        runner.warnings = resolution_warnings(config, runner.routes, self.manifest, self.datasets_dir)
        for line in runner.warnings:
            runner.event("warning", warning=line)
        return runner.start()

    def remove(self, name: str, drain: bool = False, timeout: float = 30.0) -> dict[str, Any]:
        """Stop a stream (finishing queued chunks when `drain`); returns its final metrics."""
        with self._lock:
            runner = self._streams.pop(name, None)
        if runner is None:
            raise KeyError(f"no running stream {name!r}; running: {sorted(self._streams)}")
        runner.stop(drain=drain)
        runner.join(timeout)
        try:
            runner.client.close()
        except Exception:  # the connection may be gone already
            pass
        snap = runner.snapshot()
        with self._lock:
            self._removed[name] = snap
        return snap

    def get(self, name: str) -> StreamRunner:
        with self._lock:
            return self._streams[name]

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """name -> metrics of every stream, running or removed (removed ones say "stopped")."""
        with self._lock:
            running, removed = dict(self._streams), dict(self._removed)
        return {**removed, **{name: r.snapshot() for name, r in running.items()}}

    def wait(self, timeout: float | None = None) -> bool:
        """Until every running stream is done (finite sources, max_chunks); True when they are."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            runners = list(self._streams.values())
        for runner in runners:
            runner.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return all(r.done for r in runners)

    def close(self) -> dict[str, dict[str, Any]]:
        for name in self.names:
            self.remove(name)
        return self.snapshot()

    def __enter__(self) -> "StreamManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
