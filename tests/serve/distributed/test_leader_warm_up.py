"""A tensor-parallel leader's warm-up runs on every rank (serve.distributed.driver MIRRORED): the RPC
server warms its LeaderEngine before it takes work, and rank 0 warming alone waited forever in its
first all-reduce. Two gloo ranks: the leader warms through LeaderEngine, the follower follows; both
end warm with the same waves, and then serve a request alike."""

from __future__ import annotations

import faulthandler
import os

import torch
import torch.multiprocessing as mp
from serve_cases import case_specs, make_request

from serve.distributed import free_port

RANK_TIMEOUT_S = int(os.environ.get("VLORA_TEST_RANK_TIMEOUT_S", 600))


def _rank(rank: int, port: int, ckpt: str, out: str) -> None:
    from serve import Engine, EngineConfig
    from serve.distributed import LeaderEngine, follow, join_group, leave_group

    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    join_group("cpu", rank, rank, 2, timeout_s=60)  # a rank left alone in a collective fails, not hangs
    engine = None
    try:
        engine = Engine(ckpt, EngineConfig(device="cpu", dtype="float32", tensor_parallel_size=2, adapter_slots=0,
                                           num_kv_blocks=64, warm_up="on", max_batch_size=2))
        tokens = None
        if rank == 0:
            leader = LeaderEngine(engine)
            assert leader.needs_warm_up
            leader.warm_up(side=56, frames=2)
            tokens = leader.generate(make_request(case_specs("qwen2_vl")[0], 3, ignore_eos=True)).token_ids
            leader.close()
        else:
            follow(engine)
        report = engine.warm_report
        torch.save({"steps": report.steps, "requests": report.requests, "tokens": tokens}, f"{out}.{rank}")
        leave_group(engine)
    finally:
        leave_group(engine, wait=False)


def test_a_leaders_warm_up_runs_on_every_rank(vlora_home, tmp_path):
    from zoo import build_checkpoint

    ckpt = build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")
    out = str(tmp_path / "warm")
    mp.spawn(_rank, args=(free_port(), str(ckpt), out), nprocs=2, join=True)
    leader, follower = (torch.load(f"{out}.{r}") for r in (0, 1))
    assert leader["requests"] == follower["requests"] > 0 and leader["steps"] == follower["steps"] > 0
    assert len(leader["tokens"]) == 3
