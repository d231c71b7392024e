"""A tensor-parallel group started from one process: it is rank 0, the leader, and it starts ranks
1..N-1 as child processes on its host. This is how one Ray Serve replica holds N GPUs (one engine
per tensor-parallel group), and how a benchmark or a script runs a group without torchrun.

    group = LocalGroup(checkpoint, engine_config_dict)   # engine_config["tensor_parallel_size"] = N
    group.engine.generate(requests)                      # a LeaderEngine: the Engine API
    group.close()

Each follower is a fresh interpreter running `_follow(SPEC, RANK)` (not a fork of the leader,
which may hold CUDA state, nor a multiprocessing spawn, which re-runs the parent's main module: a
Ray worker's cannot be). It reads the group's spec from a pickle file, joins the group on GPU
RANK of the GPUs the leader sees (CUDA_VISIBLE_DEVICES is inherited), builds the same engine and
follows until the leader closes. A follower whose leader dies exits: its next collective fails on the closed
connection.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .driver import LeaderEngine, follow
from .group import free_port, join_group, leave_group


@dataclass
class GroupSpec:
    checkpoint: str
    engine_config: dict
    world_size: int
    port: int
    device: str  # "cuda" or "cpu": each rank's own GPU, or gloo on the CPU
    # (device) -> (checkpoint dir, weights) built in each rank for its device, or None to load the
    # checkpoint; it travels pickled, so a module-level function or a functools.partial of one. The
    # weights: a state dict, or serve.models.random_weights.RandomWeights (drawn as the rank loads them:
    # with tensor parallel the rank keeps only its shard of each, so no rank ever holds the whole model)
    builder: Callable[[str], tuple[str, Mapping]] | None = None
    threads: int | None = None  # torch threads per rank (LocalGroup: its share of the cores, rank_threads)


def group_device(device: str) -> str:
    """The group's device kind from an engine config's device ("auto", "cuda", "cuda:1", "cpu")."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else device


def rank_threads(world: int) -> int:
    """torch threads a rank gets unless told: its share of this process's cores. With torch's default every
    rank runs as many threads as the host has cores, so N ranks put N threads on each core; on two H200s the
    ranks' host then launched the eager vision tower two to three times slower than one process alone
    (results/scaling/nvidia_h200x2/tp_vision/)."""
    from serve.rpc.tenant_processes import usable_cores

    return max(1, usable_cores() // world)


def build_rank(spec: GroupSpec, rank: int):
    """Joins the group as `rank` and builds its engine (the model split to its shard)."""
    from serve.engine import Engine, EngineConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.port))
    if spec.threads:
        torch.set_num_threads(spec.threads)
    config = EngineConfig.from_dict(spec.engine_config)
    config.tensor_parallel_size = spec.world_size
    config.device = join_group(spec.device, rank, rank, spec.world_size)
    checkpoint, weights = spec.checkpoint, None
    if spec.builder is not None:
        checkpoint, weights = spec.builder(config.device)
    return Engine(checkpoint, config, weights=weights)


class LocalGroup:
    """Rank 0 of a tensor-parallel group whose other ranks it started; `engine` is its LeaderEngine."""

    def __init__(self, checkpoint: str, engine_config: dict,
                 builder: Callable[[str], tuple[str, Mapping]] | None = None, threads: int | None = None,
                 follower: str = "serve.distributed.local_group._follow"):
        """follower: "module.function" each follower runs as function(spec_path, rank); the default
        follows the leader's engine calls, a benchmark's also runs timed steps on every rank."""
        world = int(engine_config.get("tensor_parallel_size", 1))
        if world < 2:
            raise ValueError(f"a tensor-parallel group needs tensor_parallel_size >= 2, got {world}")
        device = group_device(str(engine_config.get("device", "auto")))
        if device == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs; this process sees "
                             f"{torch.cuda.device_count()}")
        self.spec = GroupSpec(str(checkpoint), dict(engine_config), world, free_port(), device, builder,
                              threads or rank_threads(world))
        fd, self._spec_path = tempfile.mkstemp(prefix="vlora-group-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(self.spec, f)
        module, _, function = follower.rpartition(".")
        code = f"import sys; from {module} import {function}; {function}(sys.argv[1], int(sys.argv[2]))"
        self.followers = [subprocess.Popen([sys.executable, "-c", code, self._spec_path, str(rank)])
                          for rank in range(1, world)]
        engine = None
        try:
            engine = build_rank(self.spec, 0)
            self.engine = LeaderEngine(engine)
        except BaseException:
            self._stop(engine)
            raise

    def close(self, timeout_s: float = 60.0) -> None:
        """Releases the followers, ends the group together, and waits for them to exit."""
        if getattr(self, "engine", None) is None:
            return
        engine, self.engine = self.engine, None
        if any(p.poll() is not None for p in self.followers):  # a rank died: no collective can complete
            self._stop(engine.engine)
            return
        try:
            engine.close()
            leave_group(engine)
        except BaseException:
            self._stop(engine.engine)
            raise
        self._reap(timeout_s)

    def _stop(self, engine) -> None:
        """A leader that failed to start, or a group that lost a rank: the followers still alive may
        wait forever in a collective, so they are killed."""
        leave_group(engine, wait=False)
        for p in self.followers:
            p.kill()
        self._reap(10.0)

    def _reap(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        for p in self.followers:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if os.path.exists(self._spec_path):
            os.remove(self._spec_path)


def _follow(spec_path: str, rank: int) -> None:
    with open(spec_path, "rb") as f:
        spec: GroupSpec = pickle.load(f)
    engine = None
    try:
        engine = build_rank(spec, rank)
        follow(engine)
        leave_group(engine)
    finally:
        leave_group(engine, wait=False)
