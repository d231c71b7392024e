"""The guard's fixed modes as the bad seeds of the H200 load sweep showed them (issue 48): a reference
that merged whichever adapter a step prefilled, and a step the model could not foresee, each engaged
a fallback that kept the policy in the mode it had rightly left. Scripted (batch, ms) observations,
and the simulator on the H200's measured profile with deLoRA dearer on the device than profiled."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from orchestrator_cases import affine, linear_profile

from bench.serving_traces import spec_of
from serve.orchestrator import CostProfile, Mode, VLoRAConfig, VLoRAPolicy, build_policy, generate
from serve.orchestrator.pricing import fixed_costs
from serve.sim import SimConfig, simulate

H200 = Path(__file__).resolve().parents[3] / "results/serving/nvidia_h200/learned_r64_all7"


def lora_per_token(p: CostProfile, per_token: float) -> CostProfile:
    """LoRA a 0.5 ms launch plus `per_token` ms a token, unmerged and in mixture alike."""
    rows, cols = p.lora["atmm"].rows, p.lora["atmm"].cols
    for op in ("atmm", "delora"):
        p.lora[op] = affine(rows, cols, lambda a, t: 0.5 + per_token * t)
    return p


def test_the_merged_reference_holds_the_most_requested_adapter_not_the_one_a_step_prefills():
    p = lora_per_token(linear_profile(), 0.02)
    step = [("a", 1)] * 6 + [("b", 3000)]  # six of a decoding, b's picture prefilled
    unmerge, merge, top = fixed_costs(p, Mode.unmerge(), step, "atmm", 0, "a", "atmm")
    assert top == "a"  # by tokens it was b: the reference switched to b for this one step
    assert merge == p.batch_ms(Mode.mixture("a"), step)  # b's prefill through deLoRA, no switch
    # a policy that serves these steps unmerged, exactly as predicted, loses to no fixed mode: the
    # reference that merged b for each prefill and a again after priced 3000 tokens free of LoRA work
    policy = VLoRAPolicy(p, VLoRAConfig(learn=False, guard_window=8, guard_hold_steps=16))
    decode = [("a", 1)] * 6 + [("b", 1)]
    for _ in range(8):
        for batch in (step, decode):
            policy.observe(Mode.unmerge(), batch, p.batch_ms(Mode.unmerge(), batch))
    assert policy.guard.engaged == 0 and policy.guard.active is None
    assert policy.guard.last_ratio["merge"] < 1 + policy.guard.margin


def test_a_step_the_model_could_not_foresee_engages_no_fallback():
    """One mixture step 25x its price (a kernel compiled on first use, or deLoRA far dearer than
    profiled): the model learns it, and the fixed modes are priced with what the policy knew when it
    chose, so the surprise is no loss of its choosing and no fallback holds it for hundreds of steps."""
    p = linear_profile()
    policy = VLoRAPolicy(p, VLoRAConfig(guard_window=16, guard_hold_steps=64))
    decode, step = [("a", 1)] * 7, [("a", 1)] * 6 + [("b", 800)]
    for _ in range(100):  # a's requests alone, merged, as profiled
        policy.observe(Mode.merge("a"), decode, p.batch_ms(Mode.merge("a"), decode))
    policy.observe(Mode.mixture("a"), step, 25 * p.batch_ms(Mode.mixture("a"), step))
    assert policy.costs.batch_ms(Mode.mixture("a"), step) > 5 * p.batch_ms(Mode.mixture("a"), step)  # learnt
    for _ in range(15):
        policy.observe(Mode.merge("a"), decode, p.batch_ms(Mode.merge("a"), decode))
    # priced after learning, unmerge had looked 10x cheaper for that step: the guard fell back to it
    assert policy.guard.engaged == 0 and policy.guard.active is None


def test_on_a_device_where_delora_is_dearer_than_profiled_the_guard_keeps_out_of_mixture():
    """The H200's profile (deLoRA about ATMM's cost) serving a device whose deLoRA is 4x that (the
    H200's mixture prefill steps measured 4x unmerge's LoRA time, results/serving/nvidia_h200/modes.csv),
    with the engine's host work and vision tower: the load sweep's first seed at half load. The guard
    engaged the merged fallback, mixture(a) with everyone, and held the policy in it for 64 steps."""
    profile = CostProfile.load(H200 / "profile.json")
    device = copy.deepcopy(profile)
    grid = device.lora["delora"]
    grid.values = [[4 * v for v in row] for row in grid.values]
    trace = generate(spec_of(json.loads((H200 / "traces.json").read_text())["trace_load_0.5_skew0.9_seed0.jsonl"]["spec"]))
    sim = SimConfig(32, 8192, host_ms=3.0, image_ms_per_ktoken=10.0)
    policy = build_policy("v_lora", profile, {})
    result = simulate(trace, policy, device, sim)
    assert result.metrics.completed == len(trace)
    assert result.policy_stats["guard"]["engaged"] == 0
    assert result.mode_ms["mixture"] < 0.2 * sum(result.mode_ms.values())
