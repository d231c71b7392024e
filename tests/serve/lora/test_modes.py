"""Inference modes in the engine (fp32, tiny Qwen2-VL): unmerge, merge(a) and mixture(a) give the same
greedy tokens (and logits within 1e-4) for a fixed set of requests of three adapters and none, also
when the mode switches in the middle of generation; merge then unmerge restores the weights."""

from __future__ import annotations

import pytest
import torch
from adapter_cases import one_thread  # noqa: F401 (autouse: one intra-op thread here)
from mode_cases import make_engine, setup  # noqa: F401 (module fixture: checkpoint + adapters)
from serve_cases import case_specs, make_request

from serve import Engine, EngineConfig
from serve.orchestrator import Mode

MAX_NEW = 5
# (spec index, adapter): every adapter twice or once, and the base model
PLAN = [(0, "qv8"), (1, None), (2, "all16"), (1, "mix"), (0, "all16"), (1, "qv8")]


def requests(only: str | None = "") -> list:
    out = []
    specs = case_specs("qwen2_vl")
    for i, (spec, adapter) in enumerate(PLAN):
        if only != "" and adapter != only:
            continue
        r = make_request(specs[spec], MAX_NEW, ignore_eos=True)
        r.adapter, r.request_id = adapter, f"r{i}"
        out.append(r)
    return out


def run(engine: Engine, reqs, switch=None) -> dict:
    """request id -> (tokens, logits); `switch(step)` may set a mode before each step."""
    for r in reqs:
        engine.add_request(r)
    done, step = {}, 0
    while engine.has_unfinished():
        if switch is not None:
            switch(step)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return done


@pytest.fixture(scope="module")
def engine(setup):
    return make_engine(setup)


@pytest.fixture(scope="module")
def reference(engine):
    return run(engine, requests())


def assert_same(got: dict, ref: dict) -> None:
    assert set(got) <= set(ref) and got
    for rid, out in got.items():
        assert out.token_ids == ref[rid].token_ids, rid
        assert len(out.token_ids) == MAX_NEW
        for a, b in zip(out.logits, ref[rid].logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", [Mode.mixture("all16"), Mode.mixture("qv8"), Mode.merge("all16"), Mode.merge("qv8")])
def test_modes_match_unmerged(engine, reference, mode):
    engine.set_mode(mode)
    try:
        reqs = requests(mode.adapter) if mode.kind == "merge" else requests()
        assert_same(run(engine, reqs), reference)
        assert engine.stats().steps_by_mode.get(mode.kind, 0) > 0
    finally:
        engine.set_mode(Mode.unmerge())


def test_merge_runs_no_lora_and_holds_others(engine, reference):
    """merge(a): a's requests build no LoRA metadata; others wait until the mode lets them in."""
    engine.set_mode(Mode.merge("qv8"))
    try:
        assert engine.lora.step_batch([("qv8", 3)]) is None  # plain base path
        mixture = engine.lora.step_batch([("qv8", 1), (None, 2), ("mix", 1)])
        # one pass: the merged adapter's token does nothing, a token of no adapter takes only -dW (slot -2)
        assert mixture.slot_ids == (-1, -2, -2, engine.lora.slot_of("mix"))
        assert mixture.segments.host_mix_slot == engine.lora.slot_of("qv8")
        for r in requests():
            engine.add_request(r)
        for _ in range(3):
            engine.step()
        others = [s for s in engine.scheduler.waiting if s.adapter != "qv8"]
        assert len(others) == len(PLAN) - 2 and all(s.adapter == "qv8" for s in engine.scheduler.running)
        engine.set_mode(Mode.unmerge())
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert_same(done, reference)
    finally:
        engine.set_mode(Mode.unmerge())


def test_switches_mid_generation_keep_tokens(engine, reference):
    cycle = [Mode.mixture("qv8"), Mode.unmerge(), Mode.mixture("mix"), Mode.merge("all16"), Mode.mixture("all16"),
             Mode.unmerge(), Mode.mixture("qv8")]
    before = engine.stats()
    held = [None]  # merged adapter before each step

    def switch(step):
        engine.set_mode(cycle[step % len(cycle)])
        held.append(engine.lora.merged)

    got = run(engine, requests(), switch=switch)
    engine.set_mode(Mode.unmerge())
    held.append(None)
    assert_same(got, reference)
    after = engine.stats()
    switches = after.mode_switches - before.mode_switches
    log = list(engine.planner.stats.switch_log)[-switches:]
    assert switches == sum(a != b for a, b in zip(held, held[1:])) >= 4 and len(log) == switches
    assert after.switch_ms_total - before.switch_ms_total == pytest.approx(sum(ms for *_, ms in log))
    assert after.switch_ms_last == pytest.approx(log[-1][2])
    assert engine.lora.records["qv8"].refs == 0 and engine.lora.merged is None


def test_merge_unmerge_restores_weights(engine):
    merger = engine.lora.merger
    before = merger.snapshot()
    lm = engine.model.language_model
    layer0 = next(m for _, k, m in lm.projections() if k == "qkv_proj")
    assert layer0.weight.data_ptr() == merger.weights["qkv_proj"][0].data_ptr()  # views: folded in place
    engine.set_mode(Mode.merge("all16"))
    moved = max((merger.weights[k] - before[k]).abs().max().item() for k in before)
    engine.set_mode(Mode.unmerge())
    assert moved > 1e-3  # the merge changed the weights
    for k, w in before.items():
        torch.testing.assert_close(merger.weights[k], w, atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="held by"):
        engine.set_mode(Mode.merge("mix"))
        try:
            engine.lora.unload("mix")
        finally:
            engine.set_mode(Mode.unmerge())


def test_set_mode_errors(engine):
    with pytest.raises(ValueError, match="not loaded"):
        engine.set_mode(Mode.merge("nope"))


@pytest.mark.gpu
def test_mixture_graph_decode_matches_eager_on_gpu(setup):
    """bf16 on a GPU: mixture decode steps replay their graph (deLoRA in one LoRA call, the merged
    slot read from a buffer) and give the eager mixture's tokens; the merged adapter's requests and
    the others run together."""
    ckpt, adapters = setup
    outs = {}
    for graphs in (True, False):
        config = EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=256, cuda_graphs=graphs,
                              graph_batch_sizes=(1, 2, 4, 8), adapter_slots=4, max_lora_rank=16,
                              adapters=tuple(f"{n}={p}" for n, p in adapters.items()))
        eng = Engine(ckpt, config)
        eng.set_mode(Mode.mixture("all16"))
        outs[graphs] = run(eng, requests())
        stats = eng.stats()
        assert (stats.graph_steps > 0) == graphs and stats.steps_by_mode.get("mixture", 0) > 0
    for rid, out in outs[True].items():
        assert out.token_ids == outs[False][rid].token_ids, rid
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(outs[False][rid].logits), atol=2e-2, rtol=2e-2)
