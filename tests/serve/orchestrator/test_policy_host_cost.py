"""The V-LoRA policy's host cost per step is cut without changing any decision: the decisions (and
what the policy learnt) on scripted traces are those recorded before (decision_trace.py), and the
simulator times the planner's host work per step."""

from __future__ import annotations

import json

import pytest

from decision_trace import GOLDEN, record_all
from orchestrator_cases import linear_profile, req

from serve.orchestrator import build_policy
from serve.sim import SimConfig, simulate


def test_decisions_and_learning_are_those_recorded_before_the_host_cost_was_cut():
    golden = json.loads(GOLDEN.read_text())
    for name, lines in record_all().items():
        want = golden[name]["lines"]
        first = next((i for i, (a, b) in enumerate(zip(lines, want)) if a != b), min(len(lines), len(want)))
        assert lines == want, f"{name}: first difference at line {first}: {lines[first:first + 1]} != {want[first:first + 1]}"


def test_the_simulator_times_the_planners_host_work_per_step_when_asked():
    p = linear_profile()
    trace = [req(f"r{i}", "ab"[i % 2], 5.0 * i, prompt=100, out=6, image_tokens=50) for i in range(8)]
    timed = simulate(trace, build_policy("v_lora", p), p, SimConfig(time_host=True))
    assert len(timed.host_us) == timed.steps
    assert all(plan > 0 and observe > 0 and queue >= 1 for plan, observe, queue in timed.host_us)
    assert simulate(trace, build_policy("v_lora", p), p).host_us == []  # off by default: nothing kept


def test_the_planner_charges_its_host_time_to_every_policy_and_the_serving_rows_report_it_per_step():
    from bench.serving_replay import learning_columns

    p = linear_profile()
    trace = [req(f"r{i}", "ab"[i % 2], 5.0 * i, prompt=100, out=6) for i in range(8)]
    for name in ("v_lora", "merge_only"):
        res = simulate(trace, build_policy(name, p), p)
        stats = res.policy_stats
        # every step planned is counted once (plans that ran nothing too), and cost some host time
        assert stats["host_steps"] >= res.steps and stats["host_ms"] > 0, name
        per_step = learning_columns(stats)["host_us_per_step"]
        assert per_step == 1e3 * stats["host_ms"] / stats["host_steps"]
    assert learning_columns(None)["host_us_per_step"] != learning_columns(None)["host_us_per_step"]  # nan: no policy


def test_paying_the_host_time_on_the_simulated_clock_delays_the_steps_by_it():
    p = linear_profile()
    trace = [req("r", "a", 0.0, prompt=100, out=6)]  # one request: the same six steps either way
    free = simulate(trace, build_policy("v_lora", p), p, SimConfig(keep_timeline=True))
    paid = simulate(trace, build_policy("v_lora", p), p, SimConfig(keep_timeline=True, time_host=True,
                                                                    charge_host=True))
    assert [(s.seqs, s.tokens) for s in paid.timeline] == [(s.seqs, s.tokens) for s in free.timeline]
    # each step starts later by the host time before it: all earlier plans and observes, and its own plan
    done = 0.0
    for k, (plan, observe, _) in enumerate(paid.host_us):
        delay = paid.timeline[k].start_ms - free.timeline[k].start_ms
        assert delay == pytest.approx(done + plan / 1e3, abs=1e-6)
        done += (plan + observe) / 1e3
    assert paid.metrics.avg_token_latency_ms > free.metrics.avg_token_latency_ms


def test_each_decisions_predicted_step_is_its_own_batch_priced_afresh():
    """The decision's predicted step cost reuses the planned step of the plan it took (by the ids it
    admits): on a trace with dwells, holds and the guard's fallbacks, every prediction is the one
    the decided batch prices to when planned from scratch."""
    from decision_trace import RUN

    import dataclasses

    from bench.policy_cost import with_images
    from bench.serving_sim import device_profile
    from bench.serving_traces import spec_of
    from serve.orchestrator import CostProfile, generate
    from serve.orchestrator.pricing import planned_step

    profile = CostProfile.load(RUN / "profile.json")
    spec = json.loads((RUN / "traces.json").read_text())["trace_load_0.5_skew0.9_seed0.jsonl"]["spec"]
    spec = dataclasses.replace(spec_of(spec), rate=30.0, duration_s=1.5, seed=3)
    policy = build_policy("v_lora", profile, {"guard_window": 16, "guard_hold_steps": 8})
    decide, checked = policy.decide, []

    def checking(view):
        d = decide(view)
        waiting = {r.request_id: r for r in view.waiting}
        batch = [r for r in view.running if r.request_id not in set(d.pause)] + [waiting[i] for i in d.admit]
        step = planned_step(view, batch)
        if d.reason != "idle":
            want = policy.costs.batch_ms(d.mode, step.entries, policy.lora_op, step.image_tokens)
            assert policy.log[-1].predicted_ms == want, d.reason
            checked.append(d.reason.split(":")[0])
        return d

    policy.decide = checking
    simulate(with_images(generate(spec), spec), policy, device_profile(profile, 4.0),
             SimConfig(32, 8192, step_noise=0.3, noise_seed=3, image_ms_per_ktoken=10.0))
    assert len(checked) > 100 and {"dwell", "guard"} <= set(checked), set(checked)
