"""Tensor parallel on CPU: two processes (gloo), each an engine holding half of every decoder
layer and its adapters' matching LoRA shards, give the single-process engine's greedy tokens and
logits (fp32) for requests of three adapters and none, in unmerge, mixture and merge modes. With
two GPUs the same runs over NCCL against one GPU (Triton's fp32 dots run in TF32 there: logits to
1e-2)."""

from __future__ import annotations

import faulthandler
import os

import pytest
import torch
import torch.multiprocessing as mp
from adapter_cases import build_adapters
from serve_cases import case_specs, make_request

from serve import Engine, EngineConfig
from serve.distributed import free_port
from serve.orchestrator import Mode

ADAPTERS = ("qv8", "all16", "mix")
PLAN = [(0, "qv8"), (1, None), (2, "all16"), (1, "mix"), (0, "all16")]
MODES = [Mode.unmerge(), Mode.mixture("all16"), Mode.merge("qv8")]
MAX_NEW = 4
RANK_TIMEOUT_S = int(os.environ.get("VLORA_TEST_RANK_TIMEOUT_S", 600))


def _config(adapters: dict, tp: int, device: str = "cpu") -> EngineConfig:
    return EngineConfig(device=device, dtype="float32", enable_prefix_cache=False, adapter_slots=4, max_lora_rank=16,
                        num_kv_blocks=256, adapters=tuple(f"{n}={p}" for n, p in adapters.items()),
                        tensor_parallel_size=tp)


def _run_modes(engine: Engine) -> dict:
    """(mode, request id) -> (tokens, logits) over the three modes."""
    out = {}
    specs = case_specs("qwen2_vl")
    for mode in MODES:
        engine.set_mode(mode)
        requests = []
        for i, (spec, adapter) in enumerate(PLAN):
            if mode.kind == "merge" and adapter != mode.adapter:
                continue
            r = make_request(specs[spec], MAX_NEW, ignore_eos=True)
            r.adapter, r.request_id = adapter, f"{mode}-{i}"
            requests.append(r)
        for o in engine.generate(requests):
            out[o.request_id] = (o.token_ids, torch.stack(o.logits))
    engine.set_mode(Mode.unmerge())
    return out


def _rank(rank: int, world: int, port: int, ckpt: str, adapters: dict, out_path: str, lead: bool,
          device: str = "cpu") -> None:
    """lead=False: every rank runs the same calls (SPMD); lead=True: rank 0 drives through
    LeaderEngine with the V-LoRA policy deciding, rank 1 follows. device="cuda": GPU `rank`, NCCL."""
    from serve.distributed import LeaderEngine, follow, join_group, leave_group

    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)  # a rank stuck in a collective fails, with its stack
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = join_group(device, rank, rank, world)
    engine = None
    try:
        config = _config(adapters, world, device)
        if lead:
            config.policy, config.policy_params = "v_lora", {"decide": "algorithm1", "share_of": "present",
                                                             "max_switch_share": 1.0}
        engine = Engine(ckpt, config)
        layer = engine.model.language_model.layers[0]
        shapes = (engine.model.args.num_heads, engine.model.args.num_kv_heads,
                  tuple(layer.mlp.gate_up_proj.output_slices), engine.runner.kv_cache.num_blocks)
        if not lead:
            result = _run_modes(engine)
        elif rank == 0:
            leader = LeaderEngine(engine)
            bad = _requests()[0]
            bad.adapter = "not-served"
            with pytest.raises(ValueError, match="not-served"):  # refused on both ranks; neither goes down
                leader.add_request(bad)
            result = {o.request_id: (o.token_ids, torch.stack(o.logits)) for o in leader.generate(_requests())}
            leader.close()
        else:
            follow(engine)
            result = None
        modes = dict(engine.stats().steps_by_mode or {})
        if result is not None:
            result = {k: (tokens, logits.cpu()) for k, (tokens, logits) in result.items()}
        vision = {"here": engine.model.vision.items_here, "items": engine.runner.counters["items_encoded"]}
        torch.save({"result": result, "shapes": shapes, "modes": modes, "switches": engine.stats().mode_switches,
                    "vision": vision}, f"{out_path}.{rank}")
        leave_group(engine)  # on GPUs this returns only when the NCCL graphs were freed first
    finally:
        leave_group(engine, wait=False)


def _requests() -> list:
    specs = case_specs("qwen2_vl")
    out = []
    for i, (spec, adapter) in enumerate(PLAN + [(2, "qv8"), (0, "qv8"), (1, "qv8"), (2, "qv8")]):  # qv8 dominates
        r = make_request(specs[spec], MAX_NEW, ignore_eos=True)
        r.adapter, r.request_id = adapter, f"lead-{i}"
        out.append(r)
    return out


@pytest.fixture(scope="module")
def setup(vlora_home, tmp_path_factory):
    from zoo import build_checkpoint

    ckpt = build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")
    return str(ckpt), {k: str(v) for k, v in build_adapters(ckpt, tmp_path_factory.mktemp("tp_adapters"),
                                                            ADAPTERS).items()}


DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs"))])


@DEVICES
def test_two_rank_tensor_parallel_matches_one_process_in_every_mode(setup, tmp_path, device):
    ckpt, adapters = setup
    torch.set_num_threads(1)
    want = _run_modes(Engine(ckpt, _config(adapters, 1, device)))
    want = {k: (tokens, logits.cpu()) for k, (tokens, logits) in want.items()}
    out = str(tmp_path / "tp")
    mp.spawn(_rank, args=(2, free_port(), ckpt, adapters, out, False, device), nprocs=2, join=True)
    runs = [torch.load(f"{out}.{rank}", weights_only=False) for rank in (0, 1)]
    # the ranks shared the tower's work: each encoded part of the items, together all of them
    # (a step with a single item runs on both ranks, so the sum may exceed the whole)
    items = runs[0]["vision"]["items"]
    assert all(0 < run["vision"]["here"] < items for run in runs) and sum(run["vision"]["here"] for run in runs) >= items
    for got in runs:
        # the tiny model has 4 query heads, 2 K/V heads and 512 intermediate: each rank holds half
        assert got["shapes"] == (2, 1, (256, 256), 256)
        assert set(got["result"]) == set(want)
        for rid, (tokens, logits) in got["result"].items():
            assert tokens == want[rid][0], rid
            torch.testing.assert_close(logits, want[rid][1], atol=1e-4 if device == "cpu" else 1e-2, rtol=0)


@DEVICES
def test_rank_zero_leads_with_the_policy_deciding_once_for_both_ranks(setup, tmp_path, device):
    ckpt, adapters = setup
    torch.set_num_threads(1)
    want = {o.request_id: (o.token_ids, torch.stack(o.logits).cpu())
            for o in Engine(ckpt, _config(adapters, 1, device)).generate(_requests())}
    out = str(tmp_path / "lead")
    mp.spawn(_rank, args=(2, free_port(), ckpt, adapters, out, True, device), nprocs=2, join=True)
    leader, follower = (torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1))
    assert set(leader["result"]) == set(want)
    for rid, (tokens, logits) in leader["result"].items():
        assert tokens == want[rid][0], rid
        torch.testing.assert_close(logits, want[rid][1], atol=1e-4 if device == "cpu" else 1e-2, rtol=0)
    # the follower ran the very same steps in the very same modes, switches included
    assert follower["modes"] == leader["modes"] and follower["switches"] == leader["switches"]
    assert leader["switches"] > 0 and sum(leader["modes"].values()) > 0


def test_a_group_started_from_one_process_answers_like_one_process(setup):
    import dataclasses

    from serve.distributed.local_group import LocalGroup, rank_threads

    ckpt, adapters = setup
    torch.set_num_threads(1)
    want = {o.request_id: o.token_ids for o in Engine(ckpt, _config(adapters, 1)).generate(_requests())}
    group = LocalGroup(ckpt, dataclasses.asdict(_config(adapters, 2)))  # threads: each rank its share of the cores
    followers = group.followers
    try:
        # rank 0 is built in this process: it runs its share, not torch's default of every core
        assert group.spec.threads == rank_threads(2) == torch.get_num_threads()
        got = {o.request_id: o.token_ids for o in group.engine.generate(_requests())}
    finally:
        group.close()
    assert got == want
    assert [p.returncode for p in followers] == [0]  # released, left the group and exited cleanly
    with pytest.raises(ValueError, match="tensor_parallel_size >= 2"):
        LocalGroup(ckpt, dataclasses.asdict(_config(adapters, 1)))


def _vision_items(engine) -> list:
    """The mixed batch's pictures: an image, two images and a clip's two frame groups (5 items)."""
    return [it for spec in case_specs("qwen2_vl") for it in engine.prepare(make_request(spec))[0].vision]


def _whole_vision_rank(rank: int, port: int, ckpt: str, adapters: dict, out_path: str) -> None:
    """Both ranks (SPMD) with tp_vision=whole: the encoder's embeddings whole and split, then the
    requests served whole."""
    from serve.distributed import join_group, leave_group

    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    join_group("cpu", rank, rank, 2)
    engine = None
    try:
        config = _config(adapters, 2)
        config.tp_vision = "whole"
        engine = Engine(ckpt, config)
        vision, items = engine.model.vision, _vision_items(engine)
        whole = engine.model.encode(items)
        here = vision.items_here  # every item on every rank
        vision.mode = "split"
        split = engine.model.encode(items)
        vision.mode = "whole"
        result = {o.request_id: (o.token_ids, torch.stack(o.logits)) for o in engine.generate(_requests())}
        torch.save({"whole": whole, "split": split, "here": here, "items": len(items), "result": result},
                   f"{out_path}.{rank}")
        leave_group(engine)
    finally:
        leave_group(engine, wait=False)


def test_whole_vision_gives_the_split_and_one_process_embeddings_tokens_and_logits(setup, tmp_path):
    ckpt, adapters = setup
    torch.set_num_threads(1)
    one = Engine(ckpt, _config(adapters, 1))
    want_embeds = one.model.encode(_vision_items(one))
    want = {o.request_id: (o.token_ids, torch.stack(o.logits)) for o in one.generate(_requests())}
    out = str(tmp_path / "whole")
    mp.spawn(_whole_vision_rank, args=(free_port(), ckpt, adapters, out), nprocs=2, join=True)
    runs = [torch.load(f"{out}.{rank}", weights_only=False) for rank in (0, 1)]
    for got in runs:
        assert got["items"] == 5 and got["here"] == 5  # whole: no item left to a peer
        for whole, split, ref in zip(got["whole"], got["split"], want_embeds, strict=True):
            torch.testing.assert_close(whole, ref, atol=0, rtol=0)  # the same tower on the same pixels
            torch.testing.assert_close(split, whole, atol=1e-5, rtol=0)  # other batch shapes per rank
        assert set(got["result"]) == set(want)
        for rid, (tokens, logits) in got["result"].items():
            assert tokens == want[rid][0], rid
            torch.testing.assert_close(logits, want[rid][1], atol=1e-4, rtol=0)
    for a, b in zip(runs[0]["whole"], runs[1]["whole"]):
        assert torch.equal(a, b)  # the same embeddings on every rank by construction


def test_a_bad_tp_vision_is_refused_and_the_serve_config_passes_it(tmp_path):
    from omegaconf import OmegaConf

    from serve.models.parallel import SplitVision, TPGroup
    from vlora.config import compose

    with pytest.raises(ValueError, match="tp_vision='both': use split .* or whole"):
        EngineConfig(tensor_parallel_size=2, tp_vision="both")
    with pytest.raises(ValueError, match="tp_vision='halves'"):
        SplitVision(torch.nn.Identity(), TPGroup(0, 2), "halves")
    cfg = compose("serve", ["engine.tp_vision=whole"])
    assert EngineConfig.from_dict(OmegaConf.to_container(cfg.engine, resolve=True)).tp_vision == "whole"
    assert compose("serve", []).engine.tp_vision == EngineConfig().tp_vision == "split"


def test_shapes_that_do_not_split_are_refused():
    from serve.distributed import check_divisible

    class Args:  # the three sizes the split reads from serve.models.ModelArgs
        num_heads, num_kv_heads, intermediate_size = 4, 2, 512

    check_divisible(Args, 2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        check_divisible(Args, 4)


def test_vision_items_are_shared_out_by_tokens_the_same_on_every_rank():
    from serve.models.parallel import assign_items

    assert assign_items([256, 64, 1024, 64, 256], 2) == [1, 1, 0, 1, 1]  # 1024 alone vs 640
    assert assign_items([8, 8, 8], 2) == [0, 1, 0]  # ties go to the lowest rank
    owner = assign_items([5, 5], 4)
    assert owner == [0, 1]


def _idle_rank(rank: int, port: int, out_path: str) -> None:
    import time

    from serve.distributed import TPGroup, join_group, leave_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    join_group("cpu", rank, rank, 2, timeout_s=2.0)  # the model's collectives give up after 2 s
    try:
        tp = TPGroup.current()
        if rank == 0:
            time.sleep(4.0)  # an idle server: no call for longer than that timeout
            got = tp.from_leader("next call")
        else:
            got = tp.from_leader()
        torch.save(got, f"{out_path}.{rank}")
        leave_group()
    finally:
        leave_group(wait=False)


def test_a_follower_waits_for_the_next_call_past_the_collective_timeout(tmp_path):
    out = str(tmp_path / "idle")
    mp.spawn(_idle_rank, args=(free_port(), out), nprocs=2, join=True)
    assert torch.load(f"{out}.1") == "next call"


def test_a_rank_gets_its_share_of_the_cores(monkeypatch):
    # N ranks each running torch's default (every core) put N threads on a core; a rank gets cores // N
    from serve.distributed import local_group

    monkeypatch.setattr(local_group.os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    assert [local_group.rank_threads(w) for w in (2, 4, 3, 64)] == [16, 8, 10, 1]
