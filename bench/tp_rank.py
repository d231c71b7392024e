"""The tensor-parallel benchmark's ranks (bench/tp.py): the same timed work on one engine or on every
rank of a group.

A group is a `LocalGroup` whose followers run `bench_follower` instead of the plain follower: they
wait for the leader's next message on the group's control channel, and either follow the engine
calls of a `LeaderEngine` (the product path: parity runs, wall-time steps, prefill) until it closes,
or run one of `OPS` together with rank 0, so collectives inside a CUDA-graph replay, a profiled
step or the split vision tower pair up (the vision ops: bench/tp_vision.py). Each op is called the same number of times on every rank.

    ranks = Ranks.group(ckpt, engine_config, threads)    # or Ranks.single(engine)
    step_ms = ranks.call("replay", job, 32)              # rank 0's answer
    with ranks.serving() as engine: engine.generate(...) # a LeaderEngine (the engine itself alone)
    ranks.close()
"""

from __future__ import annotations

import contextlib
import pickle

import torch

from serve.orchestrator.profile import time_call_ms

from .engine import replay_step
from .step_profile import profile_on_rank0
from .tp_vision import op_vision, op_vision_profile

FOLLOW = "__follow__"  # the followers follow a LeaderEngine's calls until it closes


def _time_ms(fn, warmup: int, repeats: int, cuda: bool) -> float:
    """Median ms of `fn`: CUDA events on a GPU (vlora_kernels.timing), wall time on the CPU; the same
    number of calls either way, so every rank of a group makes as many."""
    if cuda:
        from vlora_kernels.timing import time_op

        return time_op(fn, warmup=warmup, repeats=repeats, use_graph=False) / 1e3
    return time_call_ms(fn, warmup + 1, repeats)  # + 1: time_op's warm-up and its single timed call


def op_replay(engine, job, batch: int) -> float:
    """Device ms of one decode step at `batch` sequences of job.decode_context tokens: the CUDA graph
    the engine would replay plus the LM head (bench/engine.py replay_step); NaN without graphs."""
    if engine.runner.graphs is None:
        return float("nan")
    return _time_ms(replay_step(engine, batch, [job.decode_context] * batch), 3, job.repeats, True)


def op_profile(engine, job, batch: int, rank: int) -> dict:
    """Rank 0: the replayed step's kernels under torch.profiler, NCCL's share of their time; the
    other ranks replay as many steps (1 + repeats) unprofiled. {} without graphs."""
    if engine.runner.graphs is None:
        return {}
    prof = profile_on_rank0(replay_step(engine, batch, [job.decode_context] * batch), rank, 3, cuda=True)
    if rank != 0 or "error" in prof:
        return prof
    nccl = sum(k["us"] for k in prof["kernels"] if "nccl" in k["name"].lower())
    return dict(span_us=prof["span_us"], busy_us=prof["busy_us"], nccl_us=nccl,
                comm_share=nccl / prof["span_us"] if prof["span_us"] > 0 else float("nan"))


OPS = {"replay": op_replay, "vision": op_vision, "profile": op_profile, "vision_profile": op_vision_profile}
RANKED = ("profile", "vision_profile")  # ops told the rank they run on (rank 0 profiles, the others only call)


def bench_op(engine, name: str, args: tuple, rank: int):
    """Op `name` of this benchmark on one rank (the ranked ones are told which)."""
    return OPS[name](engine, *args, **({"rank": rank} if name in RANKED else {}))


def bench_follower(spec_path: str, rank: int) -> None:
    """A follower of the benchmark's group (LocalGroup(follower="bench.tp_rank.bench_follower"))."""
    follow_ops(spec_path, rank, bench_op)


def follow_ops(spec_path: str, rank: int, run_op) -> None:
    """A follower rank of a benchmark's LocalGroup: builds its engine from the group's spec, then runs what the
    leader sends until STOP: FOLLOW follows a LeaderEngine's calls until it closes, any other name is a
    benchmark op, run as run_op(engine, name, args, rank)."""
    from serve.distributed.driver import STOP, follow
    from serve.distributed.group import leave_group
    from serve.distributed.local_group import build_rank

    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    engine = None
    try:
        engine = build_rank(spec, rank)
        tp = engine.model.tp
        while True:
            name, args, _ = tp.from_leader()
            if name == STOP:
                break
            if name == FOLLOW:
                follow(engine)
            else:
                run_op(engine, name, args, rank)
        leave_group(engine)
    finally:
        leave_group(engine, wait=False)


class Ranks:
    """One engine (tp=1) or a LocalGroup's leader: a benchmark's calls, the same either way. run_op: how an
    op runs on a rank, the one its followers' `follow_ops` is given (this benchmark's: `bench_op`)."""

    def __init__(self, engine, group=None, run_op=bench_op):
        self.engine, self.group, self.run_op = engine, group, run_op
        self.tp = 1 if group is None else group.spec.world_size

    @classmethod
    def single(cls, engine) -> "Ranks":
        return cls(engine)

    @classmethod
    def group_of(cls, checkpoint: str, engine_config: dict, threads: int | None, builder=None,
                 follower: str = "bench.tp_rank.bench_follower", run_op=bench_op) -> "Ranks":
        from serve.distributed.local_group import LocalGroup

        group = LocalGroup(checkpoint, engine_config, builder=builder, threads=threads, follower=follower)
        return cls(group.engine.engine, group, run_op)

    def _send(self, name: str, args: tuple) -> None:
        if self.group is not None:
            self.engine.model.tp.from_leader((name, args, {}))

    def call(self, name: str, *args):
        """Op `name` on every rank; rank 0's result."""
        self._send(name, args)
        return self.run_op(self.engine, name, args, 0)

    @contextlib.contextmanager
    def serving(self):
        """The Engine API for a while: a LeaderEngine whose calls every rank runs (or the engine)."""
        if self.group is None:
            yield self.engine
            return
        from serve.distributed import LeaderEngine

        self._send(FOLLOW, ())
        leader = LeaderEngine(self.engine)
        try:
            yield leader
        finally:
            leader.close()  # the followers' `follow` returns; they wait for the next op

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        else:
            self.engine.release_graphs()

    def abort(self) -> None:
        """After a failure on rank 0: the followers may wait in a collective forever, so they are
        killed (the processes this group started) and the group is left without waiting."""
        if self.group is None:
            return
        from serve.distributed.group import leave_group

        for p in self.group.followers:
            p.kill()
            p.wait()
        leave_group(self.engine, wait=False)
        self.group.engine = None
