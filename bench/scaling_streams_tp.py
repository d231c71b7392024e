"""The scaling streams workload's tp setup: one model split over `tp_size` GPUs, behind the RPyC front end.

A `LocalGroup` of `tp_size` ranks (rank 0 in this process) serves the job's zoo model from random
weights drawn on each rank (serve.models.random_weights: nothing is written, and each rank builds
and reads its shard only), so a model no single GPU holds (qwen2_vl_72b: 73.4 B parameters, 147 GB
at bf16) runs from the plan's folder of config and processor files. The cameras search as on one
engine, with `stream_counts` per group; then, where the time of a step goes, on rank 0:

    chunk    one camera chunk answered by its head (the vision tower, the prefill of ~800 tokens, the
             head) under torch.profiler, twice after a first unprofiled one
    decode   the decode step the engine replays (its CUDA graph plus the LM head; GPU only) at batch 1
             and at the cameras found, as `bench.suite=tp` profiles it (bench.tp_rank.op_profile)

Each reports its span, the time its kernels were busy and the communication inside it: NCCL's kernels
on a GPU (an all-reduce's time includes waiting for the slower rank), the collective calls on the CPU.

The followers run `tp_follower`: between serving periods, where they follow the leader's engine calls
(the warm-up's made-up waves first, on every rank, as `vlora serve` warms before it serves), they run
the ops rank 0 names (`OPS`) at the same time as rank 0, so the collectives inside pair up.
"""

from __future__ import annotations

import functools
import itertools
import time
from types import SimpleNamespace

import torch

from .scaling_streams import ScalingStreamsJob, _log, _Plan, _search
from .step_profile import by_kind, profile_on_rank0
from .tp_rank import Ranks, follow_ops

# communication in a profile: NCCL's kernels on a GPU; on the CPU the collective calls of c10d (gloo's
# own events run on its threads, overlapping those calls)
COMM = {"cuda": "nccl", "cpu": "c10d::"}
PROFILED_CHUNKS = 2  # profiled calls after the first (each is one chunk's head answer)


def rank_weights(workdir: str, seed: int, dtype: str, device: str):
    """LocalGroup's builder, in each rank: the plan's folder and its random weights on the rank's device."""
    from serve.models import RandomWeights

    return workdir, RandomWeights(workdir, seed, dtype, device)


def _comm(profile: dict, device: str) -> dict:
    """The profile's span, busy time and communication time (us) and shares."""
    if not profile or "error" in profile:
        return profile
    comm = sum(k["us"] for k in profile["kernels"] if COMM[device] in k["name"].lower())
    span, busy = profile["span_us"], profile["busy_us"]
    return {"span_us": span, "busy_us": busy, "comm_us": comm, "comm_share": comm / span if span > 0 else float("nan"),
            "comm_of_busy": comm / busy if busy > 0 else float("nan"),
            "by_kind": {k: v["us"] for k, v in by_kind(profile).items()},
            "top": [{"name": k["name"][:80], "us": k["us"]} for k in profile["kernels"][:8]]}


def op_chunk(engine, rank: int, job: ScalingStreamsJob, chunk, adapter: str) -> dict:
    """One chunk's head answer at a time, the same requests on every rank; profiled on rank 0."""
    from serve.engine import Request, SamplingParams

    from .streams_load import HEAD_TASK, _stamped

    serials = itertools.count(1)
    cuda = engine.device.type == "cuda"

    def answer() -> None:
        k = next(serials)
        engine.add_request(Request(prompt=job.prompt, video=_stamped(chunk, 10**9 + k), adapter=adapter,
                                   output_mode="head", task=HEAD_TASK, request_id=f"profiled-chunk-{k}",
                                   sampling=SamplingParams(max_tokens=job.answer_tokens, ignore_eos=True)))
        while engine.has_unfinished():
            engine.step()

    return _comm(profile_on_rank0(answer, rank, PROFILED_CHUNKS, cuda), "cuda" if cuda else "cpu")


def op_decode(engine, rank: int, context: int, batch: int) -> dict:
    """The replayed decode step at `batch` sequences of `context` tokens, profiled on rank 0 ({} without
    CUDA graphs: on the CPU)."""
    from .tp_rank import op_profile

    found = op_profile(engine, SimpleNamespace(decode_context=context), batch, rank)
    return found if not found or "error" in found else {**found, "batch": batch, "context": context}


OPS = {"chunk": op_chunk, "decode": op_decode}


def tp_op(engine, name: str, args: tuple, rank: int):
    """Op `name` of the tp setup on one rank."""
    return OPS[name](engine, rank, *args)


def tp_follower(spec_path: str, rank: int) -> None:
    """A follower of the tp setup's group (LocalGroup(follower="bench.scaling_streams_tp.tp_follower"))."""
    follow_ops(spec_path, rank, tp_op)


def run_tp(job: ScalingStreamsJob, plan: _Plan, gpus: int, meta: dict, save=None) -> list[dict]:
    """The camera search on one group of `gpus` ranks, then the profiles (meta["profile"])."""
    config = {**plan.config, "tensor_parallel_size": gpus,
              "adapters": tuple(f"{n}={p}" for n, p in plan.adapters.items()),
              # decode graphs past the batch limit are never replayed: on a large model each costs start time
              "graph_batch_sizes": tuple(b for b in plan.config["graph_batch_sizes"] if b <= job.max_batch_size)}
    t0 = time.perf_counter()
    group = Ranks.group_of(str(plan.workdir), config, None,  # threads: each rank its share of the cores
                           builder=functools.partial(rank_weights, str(plan.workdir), job.seed, job.dtype),
                           follower="bench.scaling_streams_tp.tp_follower", run_op=tp_op)
    try:
        meta["built_s"] = time.perf_counter() - t0
        meta["memory_built"] = _memory(group.engine)
        _log(f"tp ({gpus} GPUs, {job.model}): built in {meta['built_s']:.0f} s, rank 0 {meta['memory_built']}")
        with group.serving() as leader:
            if leader.needs_warm_up:  # LeaderEngine mirrors it: every rank runs the same waves
                meta["warm_up"] = leader.warm_up(side=job.image_size, frames=job.frames_per_chunk).to_dict()
            meta["load_s"] = time.perf_counter() - t0
            meta["memory_warm"] = _memory(group.engine)
            rows = _search(leader, job, plan, "tp", gpus, save=save)
    except BaseException:
        group.abort()
        raise
    if job.step_profile:
        try:
            meta["profile"] = _profiles(group, job, plan, rows)
            _log(f"tp profile: {meta['profile']}")
        except Exception as e:  # the search stands; a rank may wait in a collective, so the group is ended
            meta["profile"] = {"error": f"{type(e).__name__}: {e}"}
            group.abort()
            return rows
    group.close()
    return rows


def _memory(engine) -> dict:
    """Rank 0's parameters (what the shard holds) and the device's peak so far (GiB)."""
    params = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    out = {"rank0_param_gib": params / 2**30}
    if engine.device.type == "cuda":
        out["rank0_peak_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
    return out


def _profiles(group: Ranks, job: ScalingStreamsJob, plan: _Plan, rows: list[dict]) -> dict:
    """A chunk's head answer, then the decode step at batch 1 and at the cameras found (at most a batch)."""
    cameras = min(max((r["streams"] for r in rows if r["pass"]), default=1), job.max_batch_size)
    t0 = time.perf_counter()
    out = {"chunk": group.call("chunk", job, plan.chunks[0], next(iter(plan.adapters)))}
    out["decode"] = [d for b in sorted({1, cameras}) if (d := group.call("decode", plan.prompt_tokens, b))]
    out["seconds"] = time.perf_counter() - t0
    return out
