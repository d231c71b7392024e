"""Joining and leaving the process group of a tensor-parallel engine (torchrun, LocalGroup, tests).

The sharding itself (TPGroup, shard_model) is part of the models (serve.models.parallel); what
here starts and ends a rank's membership sits above the engine, since leaving frees the engine's
CUDA graphs first.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    """A free loopback TCP port, for the rendezvous of a group started on this host."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(device: str, local_rank: int, rank: int | None = None, world_size: int | None = None,
               timeout_s: float | None = None) -> str:
    """Joins the default process group (rank / world_size, or torchrun's environment when None):
    NCCL bound to GPU `local_rank` when device is a CUDA one, gloo otherwise. Returns the rank's
    device ("cuda:<local_rank>" or device). timeout_s: of the rendezvous and of each collective
    of the model (None: torch's default); the leader's control messages have their own."""
    given = {} if rank is None else {"rank": rank, "world_size": world_size}
    if timeout_s is not None:
        given["timeout"] = timedelta(seconds=timeout_s)
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"  # bound to the rank's GPU: collectives never guess the device
        dist.init_process_group("nccl", device_id=torch.device(device), **given)
    else:
        dist.init_process_group("gloo", **given)
    return device


def leave_group(engine=None, wait: bool = True) -> None:
    """Ends this rank's part in the default group: frees `engine`'s decode CUDA graphs (their
    captured NCCL all-reduces would make destroy_process_group hang), waits for every rank (none
    loses a peer mid-call: gloo aborts a process whose peer vanished) and destroys the group.
    `engine`: an Engine or a LeaderEngine, or None when the rank built none; wait=False on a
    failing rank, whose peers may never reach the barrier. Does nothing once the group is gone."""
    if engine is not None:
        engine.release_graphs()
    if dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()
