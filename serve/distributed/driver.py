"""Driving a tensor-parallel engine from one process: rank 0 leads, the other ranks follow.

Every rank builds the same `Engine(..., EngineConfig(tensor_parallel_size=N))`. Rank 0 wraps
it in `LeaderEngine` and hands that to whoever serves (the RPC server, a benchmark, a script);
every other rank calls `follow(engine)`, which returns when the leader closes. Each call that
changes engine state (requests added or aborted, a step, a mode, adapters) is broadcast to the
followers before rank 0 runs it, so all ranks hold the same queues and run the same steps in the
same order; the collectives inside the model then pair up. Calls that only read (stats,
has_unfinished, prepare, list_adapters) run on rank 0 alone. The orchestrator's decision of each
step is made on rank 0 and broadcast from inside the step (serve/engine/planner.py).

    if rank == 0:
        engine = LeaderEngine(Engine(ckpt, config)); ...; engine.close()
    else:
        follow(Engine(ckpt, config))
"""

from __future__ import annotations

import sys

# warm_up: every rank runs the same made-up waves (seeded, the same requests and steps); on rank 0 alone
# its first step would wait in an all-reduce no other rank joins (a server's warm-up never ended).
# abort_all: every rank holds the same requests, so each drops the same ones (on rank 0 alone, the next
# step's batch would differ between the ranks)
MIRRORED = frozenset({"add_request", "abort", "abort_all", "step", "set_mode", "load_adapter", "unload_adapter",
                      "pin_adapter", "load_manifest", "drop_caches", "warm_up"})
STOP = "__stop__"


class LeaderEngine:
    """Rank 0's engine: the Engine API, with state-changing calls mirrored on every rank."""

    def __init__(self, engine):
        tp = getattr(engine.model, "tp", None)
        if tp is None or tp.rank != 0:
            raise ValueError("LeaderEngine wraps the rank-0 engine of a tensor-parallel group")
        self.engine, self.tp, self.closed = engine, tp, False

    def __getattr__(self, name: str):
        attr = getattr(self.engine, name)
        if name not in MIRRORED:
            return attr

        def mirrored(*args, **kwargs):
            self._send(name, args, kwargs)
            return attr(*args, **kwargs)

        return mirrored

    def _send(self, name: str, args: tuple, kwargs: dict) -> None:
        if self.closed:
            raise RuntimeError(f"{name}: the tensor-parallel group was closed")
        self.tp.from_leader((name, args, kwargs))

    def add_request(self, request, prepared=None) -> str:
        """Mirrored with the raw request: each follower preprocesses it itself. The prepared pixels
        are float32, about eight times the bytes of the uint8 images, to pickle and send per request."""
        self._send("add_request", (request,), {})
        return self.engine.add_request(request, prepared)

    def generate(self, requests):
        """Engine.generate through the mirrored calls."""
        single = not isinstance(requests, (list, tuple))
        ids = [self.add_request(r) for r in ([requests] if single else requests)]
        done = {}
        while self.engine.has_unfinished():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        outs = [done[i] for i in ids]
        return outs[0] if single else outs

    def close(self) -> None:
        """Releases the followers (their `follow` returns)."""
        if not self.closed:
            self.tp.from_leader((STOP, (), {}))
            self.closed = True


def follow(engine) -> int:
    """Runs, on a rank other than 0, every call the leader sends until it closes; returns how many."""
    tp = getattr(engine.model, "tp", None)
    if tp is None or tp.rank == 0:
        raise ValueError("follow runs on ranks 1.. of a tensor-parallel group; rank 0 uses LeaderEngine")
    calls = 0
    while True:
        name, args, kwargs = tp.from_leader()
        if name == STOP:
            return calls
        if name not in MIRRORED:
            raise RuntimeError(f"the leader sent {name!r}, which is not a mirrored engine call")
        try:
            getattr(engine, name)(*args, **kwargs)
        except (ValueError, TypeError, KeyError) as e:
            # a bad call (an unknown adapter, a prompt too long) fails the same way on the leader,
            # which answers its caller; the ranks still hold the same state, so this one goes on
            print(f"tensor-parallel rank {tp.rank}: {name} refused, as on the leader: {e}", file=sys.stderr, flush=True)
        calls += 1
