"""The engine behind the streams suite's server, run as `vlora serve` runs it.

`vlora serve` runs the engine's step loop in a process of its own (rpc.engine_process, the default):
the front end's connection threads decode frames, prepare prompts and answer polls on another
interpreter, so no amount of client traffic takes the step loop's. With the loop on a thread of the
server's process instead (rpc.engine_process=false, as under tensor parallel and replicas), every
poll of N cameras competes with it for one interpreter; past capacity more chunks are pending, the
cameras poll more, the steps' host work slows and the backlog grows (an H200 at 44 cameras served
18 chunks/s this way in one run and 42 in another, its GPU idle half the time).

`Served` is the bench's handle on either: `run(fn)` runs fn(engine) where the engine is, and
`server(n)` gives the RPyC server of a point. In a process of its own the engine is built there
(`build_in_process`: the same zoo model and seed, so the same weights) and warmed up on its loop's
thread before the server takes work, as `vlora serve` does, and one server serves every point; on a
thread, each point gets a fresh server over the bench's engine, as before. The functions below that
take the engine first are what crosses to the engine process (module-level, so they pickle).
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import time


def build_in_process(job, workdir: str, prompt_tokens: int, threads: int):
    """The engine process's build: the random model of `job` (seeded as the bench's own), its engine
    and adapters. The engine loop's thread warms it up (for the job's chunk shape, from its config)
    before it takes work, as under `vlora serve`. (Warmed up here, on the build's thread, the serving
    thread's first step took 154 ms for one chunk in bf16 and 276 ms in FP8, where the warm points'
    one-chunk steps took 60-100 ms, and a backlog followed: an H200, 2026-12-02.)"""
    from pathlib import Path

    import torch

    from .engine import build_random_model
    from .streams import _engine

    torch.set_num_threads(threads)
    hf, _ = build_random_model(job.model, job.seed, job.dtype, job.device, Path(workdir))
    engine, _ = _engine(job, Path(workdir), hf, prompt_tokens)
    del hf
    return engine


def abort_all(engine) -> int:
    return engine.abort_all()


def marks(engine) -> tuple[int, dict, int]:
    """(steps so far, the runner's counters, late compiles so far): a point counts from these."""
    from serve.engine.compile_watch import WATCH

    return engine.num_steps, dict(engine.runner.counters), len(WATCH.late)


def since(engine, before: tuple[int, dict, int], first: int = 0) -> dict:
    """The row's engine columns since `marks` gave `before`: steps, slowest steps, pictures encoded,
    Triton kernels compiled after the warm-up."""
    from serve.engine.compile_watch import WATCH

    from .streams_load import _steps, encoded_since

    steps, counters, late = before
    return {**_steps(engine, engine.num_steps - steps, first=first), **encoded_since(engine, counters),
            "late_compiles": [spec for _, spec in WATCH.late[late:]]}


def set_encode_ahead(engine, on: bool) -> bool:
    """Sets the engine's encode_ahead; returns what it was."""
    before, engine.encode_ahead = engine.encode_ahead, on
    return before


class Served:
    def __init__(self, engine=None, process=None, max_connections: int = 72, freeze: bool = False):
        """engine: the bench's engine (the loop runs on a thread of this process); process: a started
        serve.rpc.EngineProcess (the engine in a process of its own) served by one long-lived server."""
        self.engine, self.process = engine, process
        self.token = secrets.token_hex(16)
        self._server = None
        if process is not None:
            from serve.rpc import Limits, RpcServer

            self._server = RpcServer(process, self.token, "127.0.0.1", 0, Limits(),
                                     max_connections=max_connections, freeze=freeze).start()

    @classmethod
    def spawn(cls, job, workdir, prompt_tokens: int, max_connections: int) -> tuple["Served", float]:
        """The engine built in a process of its own and its server started, returned once the engine
        has warmed up and takes work; (handle, seconds from the spawn)."""
        import torch

        from serve.rpc import EngineProcess

        t0 = time.perf_counter()
        process = EngineProcess(functools.partial(build_in_process, job, str(workdir), prompt_tokens,
                                                  torch.get_num_threads())).start()
        # as `vlora serve` does, the front end's heap frozen before it serves (serve.rpc.memory.freeze_heap); on a
        # GPU only, as the engine's own warm-up: tests build many servers in one process
        served = cls(process=process, max_connections=max_connections, freeze=job.device.startswith("cuda"))
        while process.warming is not None:
            if not process.alive:
                raise RuntimeError(process.down_reason or "the engine process exited while warming up")
            time.sleep(0.05)
        return served, time.perf_counter() - t0

    @property
    def in_thread(self) -> bool:
        return self.process is None

    def run(self, fn, timeout: float = 600.0):
        """fn(engine) where the engine is (fn picklable when it is in a process of its own)."""
        return fn(self.engine) if self.process is None else self.process.call(fn, timeout)

    @contextlib.contextmanager
    def server(self, n: int, cold: bool = False):
        """A point's server for n cameras: (server, seconds its thread spent warming up or None).
        On a thread, a fresh server per point (`cold`: its thread warms the engine up first, as
        `vlora serve` does); in a process of its own, the one server (warmed up before the first point)."""
        if self._server is not None:
            yield self._server, None
            return
        from serve.rpc import Limits, RpcServer

        server = RpcServer(self.engine, self.token, "127.0.0.1", 0, Limits(), max_connections=n + 8)
        warm_s = None
        if cold and self.engine.needs_warm_up:  # for the job's chunk shape: the engine config says it
            t = time.perf_counter()
            server.start()
            while server.loop.warming is not None:
                time.sleep(0.05)
            warm_s = time.perf_counter() - t
        else:
            server.start()
        try:
            yield server, warm_s
        finally:
            server.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()  # stops the engine process too
            self._server = None


def max_connections(job) -> int:
    """The long-lived server's connection limit: the most cameras of any point, and room for more."""
    return max([*job.stream_counts, *job.ahead_off_counts, job.cold_streams, 1]) + 8
