"""Every policy is total over the numbers a request carries: a target or priority at the ends of the
float range (or past them: NaN, inf, 0, negative), a prompt or output of any length, and a measured
profile whose cells reach 0 never make `decide` raise. A step whose policy raised used to fail the
whole batch (slo_ms=5e-324 gave a starving threshold of 0.0 and a ZeroDivisionError)."""

from __future__ import annotations

import math

import pytest
from orchestrator_cases import affine, linear_profile, req, view

from serve.orchestrator import POLICIES, CostProfile, Mode, assumed_profile, build_policy
from serve.orchestrator.policy import MIN_THRESHOLD_MS, VLoRAPolicy

SLOS = [5e-324, 1e-300, 1e-3, 1e308, math.inf, math.nan, 0.0, -5.0, None]
PRIORITIES = [5e-324, 1e-300, 1.0, 1e300, 1.7976931348623157e308]
MODES = [Mode.unmerge(), Mode.merge("a"), Mode.mixture("a")]


def extreme_queue():
    waiting, i = [], 0
    for slo in SLOS:
        for priority in PRIORITIES:
            adapter = ("a", "b", None)[i % 3]
            waiting.append(req(f"w{i}", adapter, float(i), prompt=1 + i * 37, out=1 + i * 101, slo_ms=slo,
                               priority=priority))
            i += 1
    return waiting


def zero_profile() -> CostProfile:
    """A measured profile can hold 0.0 cells (LoRA deltas clipped at 0; steps cheaper than the timer)."""
    rows, cols = [1, 1024], [1, 65536]
    zero = affine(rows, cols, lambda r, c: 0.0)
    return CostProfile(base=zero, lora={"atmm": zero, "delora": zero, "einsum": zero},
                       switch_ms={"atmm": 0.0, "addmm": 0.0}, name="zero-test")


@pytest.mark.parametrize("profile", [linear_profile(), assumed_profile(), zero_profile()], ids=lambda p: p.name)
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_decides_over_extreme_request_numbers(name, profile):
    waiting = extreme_queue()
    running = [req("r0", "a", -5.0, computed_tokens=100, generated_tokens=9, slo_ms=5e-324, priority=1e300),
               req("r1", "b", -4.0, out=2, computed_tokens=100, generated_tokens=1, slo_ms=1e308, priority=5e-324)]
    for mode in MODES:
        for batch in (4, 64):
            policy = build_policy(name, profile, {"max_switch_share": 1.0} if name.startswith("v_lora") else {})
            for now in (0.0, 1e6, 1e300):
                d = policy.decide(view(now, waiting, running if mode.kind != "merge" else running[:1], mode,
                                       max_batch_size=batch))
                assert len(d.admit) <= batch


def test_a_target_below_one_step_is_starving_at_once():
    policy = VLoRAPolicy(linear_profile())
    for slo in (5e-324, 1e-300, 0.0, -1.0, math.nan):
        r = req("x", "b", 0.0, slo_ms=slo)
        assert policy.threshold_ms(r) == MIN_THRESHOLD_MS
        assert [s.request_id for s in policy.starving(view(0.0, [r]))] == ["x"], slo
    huge = req("y", "b", 0.0, slo_ms=1e308, priority=5e-324)  # 0.5 * 1e308 / 5e-324 = inf: never starving
    assert policy.threshold_ms(huge) == math.inf and not policy.starving(view(1e300, [huge]))
