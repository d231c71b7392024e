"""A serve.orchestrator policy driving the engine (fp32, tiny Qwen2-VL): V-LoRA's policy merges the
adapter that dominates, takes a starving request of another adapter in through mixture, unmerges when
no adapter dominates; tokens equal the plain FCFS engine's; the stats account for every switch; the
cost profile is measured at start without leaving a trace in the weights."""

from __future__ import annotations

import pytest
from adapter_cases import one_thread  # noqa: F401 (autouse: one intra-op thread here)
from serve_cases import case_specs, make_request
from mode_cases import make_engine, setup  # noqa: F401 (module fixture: checkpoint + adapters)

from serve import EngineConfig

MAX_NEW = 5
POLICY = {"max_switch_share": 1.0}  # no dwell after a switch: the scripted queue switches at once


def scripted_requests():
    """Three requests of qv8 (3 > merge_share * max_batch = 2: qv8 dominates), then one of all16
    with a 1 ms target, so it starves on arrival."""
    specs = case_specs("qwen2_vl")
    reqs = []
    for i, (spec, adapter) in enumerate([(0, "qv8"), (1, "qv8"), (2, "qv8"), (1, "all16")]):
        r = make_request(specs[spec], MAX_NEW, ignore_eos=True)
        r.adapter, r.request_id = adapter, f"s{i}"
        reqs.append(r)
    reqs[-1].slo_ms = 1.0
    return reqs


def drive(engine):
    """Three qv8 requests first; after two steps the starving all16 request arrives."""
    reqs = scripted_requests()
    for r in reqs[:3]:
        engine.add_request(r)
    done, modes, step = {}, [], 0
    while engine.has_unfinished():
        if step == 2:
            engine.add_request(reqs[3])
        done.update({o.request_id: o for o in engine.step() if o.finished})
        modes.append(str(engine.mode))
        step += 1
    return done, modes


def test_v_lora_merges_then_mixture_then_unmerge(setup):  # noqa: F811
    """Algorithm 1's rule (decide="algorithm1")."""
    ref, _ = drive(make_engine(setup, max_batch_size=4))
    engine = make_engine(setup, max_batch_size=4, policy="v_lora", policy_params={**POLICY, "decide": "algorithm1"})
    assert engine.cost_profile.assumed
    done, modes = drive(engine)
    for rid, out in ref.items():
        assert done[rid].token_ids == out.token_ids, rid
    assert modes[:2] == ["merge(qv8)", "merge(qv8)"]
    assert modes[2] == "mixture(qv8)"  # the starving all16 request joins through deLoRA
    assert modes[-1] == "unmerge"  # all16 alone does not dominate
    stats = engine.stats()
    pstats = stats.policy_stats
    assert stats.mode_switches == pstats["switches"] == 2  # base -> qv8 -> base
    assert stats.switch_ms_total > 0 and stats.switch_ms_last > 0
    assert sum(stats.steps_by_mode.values()) == pstats["decisions"]
    assert {"merge", "mixture", "unmerge"} <= set(pstats["reasons"])
    assert engine.lora.merged is None and engine.lora.records["qv8"].refs == 0


def test_v_lora_by_cost_keeps_tokens_and_explains_each_decision(setup):  # noqa: F811
    ref, _ = drive(make_engine(setup, max_batch_size=4))
    engine = make_engine(setup, max_batch_size=4, policy="v_lora", policy_params=POLICY)
    done, modes = drive(engine)
    assert {r: o.token_ids for r, o in done.items()} == {r: o.token_ids for r, o in ref.items()}
    assert modes[0] == "merge(qv8)"  # three of qv8 fill most of the batch: held, merged
    assert "mixture(qv8)" in modes  # the starving all16 request is never held: it joins through deLoRA
    log = list(engine.planner.policy.log)
    assert all("cheapest per token" in r.reason or r.reason == "idle" for r in log)
    assert engine.stats().mode_switches == engine.planner.policy.stats.switches >= 1


@pytest.mark.parametrize("policy", ["merge_only", "unmerge_only", "dlora", "dlora_atmm", "v_lora_paper"])
def test_baseline_policies_keep_tokens(setup, policy):  # noqa: F811
    ref, _ = drive(make_engine(setup, max_batch_size=4))
    engine = make_engine(setup, max_batch_size=4, policy=policy)
    # each policy's steps run the operator it plans with: dLoRA's einsum, or the engine's own
    assert engine.lora.backend == ("einsum" if policy == "dlora" else engine.lora.configured_backend)
    assert engine.lora.switch_method == ("addmm" if policy == "dlora" else None)  # dLoRA's per-layer switches
    done, modes = drive(engine)
    assert {r: o.token_ids for r, o in done.items()} == {r: o.token_ids for r, o in ref.items()}
    if policy == "unmerge_only":
        assert set(modes) == {"unmerge"} and engine.stats().mode_switches == 0
    if policy == "merge_only":
        assert "merge(qv8)" in modes and "merge(all16)" in modes


def test_measured_profile(setup):  # noqa: F811
    ref, _ = drive(make_engine(setup, max_batch_size=4))
    engine = make_engine(setup, max_batch_size=4, policy="v_lora", policy_params=POLICY, profile="measure",
                         profile_shapes=dict(seqs=[1, 4], tokens=[1, 16], adapters=[1, 2],
                                             lora_ops=["atmm", "delora"], switch_ops=["atmm", "addmm"]))
    p = engine.cost_profile
    assert not p.assumed and p.device == "cpu"
    assert set(p.lora) == {"atmm", "delora"} and p.switch_ms["atmm"] > 0 and p.switch_ms["addmm"] > 0
    assert p.base(4, 16) > 0
    assert engine.stats().eager_steps == 0  # profiling steps ran through the runner but are not served steps
    done, _ = drive(engine)  # the switch round trips left the weights as they were
    assert {r: o.token_ids for r, o in done.items()} == {r: o.token_ids for r, o in ref.items()}


def test_config_policy_from_dict():
    cfg = EngineConfig.from_dict({"policy": {"name": "v_lora", "tolerance": 0.3}, "device": "cpu"})
    assert cfg.policy == "v_lora" and cfg.policy_params == {"tolerance": 0.3}
    assert EngineConfig.from_dict({"policy": "dlora", "policy_params": {}}).policy == "dlora"
    assert EngineConfig.from_dict({"policy": "dlora"}).policy == "fcfs"  # conf/serve.yaml's bare name


def test_simulator_and_engine_take_the_same_decisions_on_one_trace(setup):  # noqa: F811
    """The same trace (every request there at the start, targets far away so no credit runs out,
    no dwell) through the real engine and through the simulator, each with the cost policy on the
    same profile, the policy learning from every step: the simulator replays the engine's measured
    step and switch times, so both policies learn the same costs, and the decisions (mode,
    admitted, waiting, running) agree step for step, because both drive the same scheduler and
    planner and the policy reads only the queue, the profile and the steps it is shown."""
    from serve.orchestrator import RequestView, assumed_profile, build_policy
    from serve.engine import Request, SamplingParams
    from serve.sim import SimConfig, simulate

    plan = [("qv8", 40, 8), ("qv8", 25, 8), ("all16", 30, 5), ("qv8", 50, 8), ("mix", 20, 6), ("qv8", 35, 8),
            ("qv8", 22, 8), (None, 18, 3), ("qv8", 45, 8), ("qv8", 28, 8), ("all16", 20, 4), ("qv8", 30, 8)]
    # ids in arrival order (the simulator breaks the tie of equal arrival times by id)
    trace = [RequestView(f"r{i:02d}", a, 0.0, p, o, slo_ms=1e9) for i, (a, p, o) in enumerate(plan)]
    params = {"max_switch_share": 1.0}
    limits = dict(max_batch_size=4, max_tokens_per_step=64)

    engine = make_engine(setup, policy="v_lora", policy_params=params, num_kv_blocks=256, **limits)
    policy = engine.planner.policy
    policy.log = type(policy.log)(maxlen=None)
    for r in trace:
        engine.add_request(Request(prompt_token_ids=[5 + (7 * i) % 200 for i in range(r.prompt_tokens)],
                                   adapter=r.adapter, request_id=r.request_id, slo_ms=r.slo_ms,
                                   sampling=SamplingParams(max_tokens=r.output_tokens, ignore_eos=True)))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().policy_stats["learning"]["observed"] == engine.num_steps  # every step measured was learnt from

    sim_policy = build_policy("v_lora", assumed_profile(), params)
    sim_policy.log = type(sim_policy.log)(maxlen=None)
    measured = SimConfig(**limits, step_times_ms=[t * 1e3 for *_, t in engine.step_log],
                         switch_times_ms=[ms for *_, ms in engine.planner.stats.switch_log])
    simulate(trace, sim_policy, assumed_profile(), measured)

    def decisions(log):
        return [(d.mode, d.admitted, d.waiting, d.running) for d in log]

    modes = {d.mode for d in sim_policy.log}
    assert len(sim_policy.log) > 10 and {"merge(qv8)", "mixture(qv8)"} <= modes  # qv8 held, then the others mixed in
    assert decisions(policy.log) == decisions(sim_policy.log)
    assert sim_policy.costs.weights == policy.costs.weights  # the same steps learnt alike
