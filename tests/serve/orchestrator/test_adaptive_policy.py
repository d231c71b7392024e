"""V-LoRA's policy priced by whole steps, learning its costs from measured steps, and guarded
against losing to a fixed mode: scripted queues, scripted (batch, ms) observations, and the
simulator running a policy profiled on one device against another's costs."""

from __future__ import annotations

import random
import statistics

import pytest
from orchestrator_cases import affine, linear_profile, req, view

from serve.orchestrator import Mode, VLoRAConfig, VLoRAPolicy, WorkloadSpec, build_policy, generate
from serve.orchestrator.guard import FixedModeGuard
from serve.orchestrator.learned import LearnedCosts
from serve.orchestrator.pricing import planned_step
from serve.sim import SimConfig, simulate


def prefill_heavy(lora_per_token: float = 0.02):
    """LoRA cheap at decode (0.5 ms launch) and dear per prefill token: rank 64 on all projections."""
    p = linear_profile()
    rows, cols = p.lora["atmm"].rows, p.lora["atmm"].cols
    p.lora["atmm"] = affine(rows, cols, lambda a, t: 0.5 + lora_per_token * t)
    p.lora["delora"] = affine(rows, cols, lambda a, t: 0.5 + lora_per_token * t)
    return p


def video_queue():
    """Six video frames' requests of `a` answered by its head (1000 prompt tokens, one prefill) and one of `b`."""
    return [req(f"a{i}", "a", float(i), prompt=1000, out=1, output_mode="head", image_tokens=768) for i in range(6)] \
        + [req("b0", "b", 2.5, prompt=1000, out=1, output_mode="head", image_tokens=768)]


# ---- whole-step prices ------------------------------------------------------------------------------
def test_the_planned_step_is_the_schedulers_running_first_then_admitted_chunks_under_the_budget():
    running = [req("dec", "a", 0.0, prompt=50, out=5, computed_tokens=50, generated_tokens=2),
               req("pre", "a", 0.0, prompt=300, out=5, computed_tokens=100, image_tokens=100)]
    waiting = [req("w0", "b", 1.0, prompt=120, out=3, image_tokens=60), req("w1", "b", 2.0, prompt=400, out=1,
                                                                             output_mode="head")]
    step = planned_step(view(5.0, waiting, running, max_tokens_per_step=400), [*running, *waiting])
    assert step.entries == [("a", 1), ("a", 200), ("b", 120), ("b", 79)]  # w1 gets what the budget leaves
    assert step.image_tokens == 100 + 60  # the images of the chunks prefilled (pre's last 200 of 200 left)
    # dec goes on (2 more tokens after this one), pre and w0 sample their first token and go on; w1 is a head
    assert [r.request_id for r in step.goes_on] == ["dec", "pre", "w0"]
    assert step.horizon == pytest.approx((2 + 4 + 2) / 3)


def test_prefill_heavy_steps_are_priced_whole_and_merge_the_dominant_adapter():
    """Decode-only prices see seven one-token steps where LoRA is a 0.5 ms launch and unmerge;
    the step actually run prefills 7000 tokens, where unmerge's LoRA costs 140 ms and holding b
    while a runs merged costs none."""
    p = prefill_heavy()
    v = view(10.0, video_queue(), max_tokens_per_step=8192)
    d = VLoRAPolicy(p, VLoRAConfig(price="decode")).decide(v)
    assert d.mode == Mode.unmerge() and len(d.admit) == 7
    policy = VLoRAPolicy(p)
    d = policy.decide(v)
    assert d.mode == Mode.merge("a") and d.switch and d.admit == tuple(f"a{i}" for i in range(6))
    assert d.reason.startswith("hold(a): cheapest per token")
    everyone = sorted(video_queue(), key=lambda r: r.arrival_ms)
    mine = [r for r in everyone if r.adapter == "a"]
    assert policy.hold_cost(v, "a", mine) < policy.plan_cost(v, Mode.mixture("a"), everyone) \
        < policy.plan_cost(v, Mode.unmerge(), everyone)
    # the decision's step is predicted and logged: plain prefill of a's 6000 tokens
    assert policy.log[-1].predicted_ms == pytest.approx(p.batch_ms(Mode.merge("a"), [("a", 1000)] * 6))


def test_a_switch_is_spread_over_the_stints_the_policy_has_measured():
    """The same plan with a dearer switch: a policy whose modes have stayed long (a long mean stint)
    still merges; one that has been switching every step pays the switch in one step and does not."""
    p = prefill_heavy(0.002)  # a 14 ms LoRA saving in the step
    p.switch_ms["atmm"] = 40.0  # 40 ms to merge
    steady, flapping = VLoRAPolicy(p), VLoRAPolicy(p)
    steady._dwell_steps, flapping._dwell_steps = 64.0, 1.0
    assert steady.decide(view(10.0, video_queue())).mode.kind == "merge"
    assert flapping.decide(view(10.0, video_queue())).mode == Mode.unmerge()


# ---- learning from measured steps ---------------------------------------------------------------------
def _truth(costs: LearnedCosts, mode, batch, images, scale=1.0):
    """The device the profile was not measured on: 3 ms host work, base twice the profile's, ATMM 1.5x,
    deLoRA 1.2x, 0.4 ms per 1000 image tokens."""
    x = costs.features(*costs.batch_shape(mode, batch), image_tokens=images)
    w = [3.0, 2.0, 2.0, 1.5, 1.2, 1.0, 0.4]
    return scale * sum(a * b for a, b in zip(w, x))


def _random_step(rng):
    mode = rng.choice([Mode.unmerge(), Mode.mixture("a"), Mode.merge("a")])
    n = rng.randint(1, 16)
    batch = [("a" if mode.kind == "merge" else rng.choice(["a", "b", "c", None]),
              1 if rng.random() < 0.7 else rng.randint(16, 900)) for _ in range(n)]
    images = sum(t for _, t in batch if t > 1) // 2
    return mode, batch, images


def test_learned_costs_fit_measured_steps_then_follow_a_shift():
    costs = LearnedCosts(linear_profile(), window=200)
    rng = random.Random(0)
    held_out = [_random_step(rng) for _ in range(20)]

    def errors():
        return [abs(costs.batch_ms(m, b, image_tokens=i) / _truth(costs, m, b, i) - 1) for m, b, i in held_out]

    assert statistics.median(errors()) > 0.3  # the profile alone is far off this device
    for i in range(300):
        mode, batch, images = _random_step(rng)
        costs.observe(mode, batch, _truth(costs, mode, batch, images), image_tokens=images)
    report = costs.report()
    assert report["observed"] == 300 and report["median_abs_rel_err"] < 0.02 and report["within_15pct"] > 0.9
    assert max(errors()) < 0.05
    for _ in range(600):  # the workload shifts (or the GPU clocks down): everything 1.5x
        mode, batch, images = _random_step(rng)
        costs.observe(mode, batch, _truth(costs, mode, batch, images, 1.5), image_tokens=images)
    mode, batch, images = _random_step(rng)
    assert costs.batch_ms(mode, batch, image_tokens=images) == pytest.approx(
        _truth(costs, mode, batch, images, 1.5), rel=0.03)


@pytest.mark.parametrize("jump", [1.0, 1.3])
def test_a_heavy_tail_of_slow_steps_does_not_drag_the_typical_prediction(jump):
    """One step in five takes 2-3x as long (another process on the host): least squares alone would
    chase their mean; the Huber weights and the shape factors keep the typical step's prediction
    close. With jump=1.3 decode steps of 8-15 sequences cost 30% more than any line through the
    others (a graph bucket): the factor of that shape takes most of it."""
    p = linear_profile()
    costs = LearnedCosts(p, window=300)
    rng = random.Random(1)

    def truth(n):
        batch = [("a", 1)] * n
        return batch, (2.0 + p.batch_ms(Mode.unmerge(), batch)) * (jump if 8 <= n <= 15 else 1.0)

    for _ in range(600):
        batch, ms = truth(rng.randint(1, 16))
        slow = rng.random() < 0.2
        costs.observe(Mode.unmerge(), batch, ms * (rng.uniform(2, 3) if slow else rng.uniform(0.98, 1.02)))
    tolerance = 0.05 if jump == 1.0 else 0.15
    for n in (1, 3, 6, 8, 12, 16):
        batch, ms = truth(n)
        assert costs.batch_ms(Mode.unmerge(), batch) == pytest.approx(ms, rel=tolerance), n
    assert costs.report()["median_abs_rel_err"] < tolerance


def test_unobserved_parts_keep_the_profiles_cost_and_switches_learn_their_measured_time():
    p = linear_profile()
    costs = LearnedCosts(p, window=100)
    assert costs.batch_ms(Mode.mixture("a"), [("b", 10)]) == p.batch_ms(Mode.mixture("a"), [("b", 10)])
    for n in range(1, 60):  # unmerge steps only, exactly as profiled
        costs.observe(Mode.unmerge(), [("a", n), ("b", 1)], p.batch_ms(Mode.unmerge(), [("a", n), ("b", 1)]))
    assert costs.batch_ms(Mode.mixture("a"), [("b", 10)]) == pytest.approx(p.batch_ms(Mode.mixture("a"), [("b", 10)]),
                                                                           rel=1e-3)
    for _ in range(30):
        costs.observe_switch("atmm", 2, 30.0)  # merge(a) -> merge(b): two folds of 15 ms, not the profile's 5
    assert costs.switch_cost_ms("atmm", "a", "b") == pytest.approx(30.0, rel=0.01)


# ---- the guard ----------------------------------------------------------------------------------------
def test_the_guard_engages_on_a_measured_loss_holds_then_retries_with_a_longer_hold():
    fair = FixedModeGuard(window=10)
    for _ in range(30):  # the model is 2x off on every mode alike: that is no loss
        assert fair.observe(24.0, 0.0, 12.0, 12.0, 14.0) is None
    g = FixedModeGuard(window=10, margin=0.05, hold_steps=20, cool_steps=50)
    for _ in range(9):  # the modes chosen cost 20% more than unmerge would have for the same batches
        assert g.observe(12.0, 0.0, 12.0, 10.0, 15.0) is None
    assert g.observe(12.0, 0.0, 12.0, 10.0, 15.0) == "unmerge" and g.last_ratio["unmerge"] == pytest.approx(1.2)
    held = [g.observe(12.0, 0.0, 12.0, 12.0, 12.0) for _ in range(20)]
    assert held[:-1] == ["unmerge"] * 19 and held[-1] is None  # released after 20 steps: a trial
    for _ in range(10):  # losing again soon after, to the merged mode, by its switches: back, twice as long
        state = g.observe(10.0, 3.0, 10.0, 10.5, 10.0)
    assert state == "merge" and g.last_ratio["merge"] == pytest.approx(1.3)
    assert g.engaged == 2 and g.hold == 40 and g.left == 40 and g.fallback_steps == 20
    with pytest.raises(ValueError, match="margin"):
        FixedModeGuard(margin=1.5)


def test_the_policy_falls_back_to_the_fixed_mode_the_guard_names_and_reports_it():
    p = linear_profile()  # deLoRA twice ATMM's per-token cost
    policy = VLoRAPolicy(p, VLoRAConfig(guard_window=4, guard_hold_steps=8, max_switch_share=1.0))
    v = view(10.0, video_queue())
    first = policy.decide(v)
    assert policy.guard.active is None and not first.reason.startswith("guard")
    batch = [(f"x{i}", 1000) for i in range(6)]  # six adapters in mixture(x0), a 50 ms switch before each step
    for _ in range(4):
        policy.observe(Mode.mixture("x0"), batch, policy.costs.batch_ms(Mode.mixture("x0"), batch), 0, 50.0, 2)
    assert policy.guard.active == "unmerge" and policy.stats.as_dict()["guard"]["engaged"] == 1
    assert policy.log[0].measured_ms is not None  # the first decision's step, measured
    d = policy.decide(v)
    assert d.mode == Mode.unmerge() and d.reason.startswith("guard: losing to fixed unmerge")
    policy.guard.active = "merge"  # the merged fixed mode: a merged, everyone else through deLoRA
    d = policy.decide(view(20.0, video_queue(), mode=d.mode))
    assert d.mode == Mode.mixture("a") and len(d.admit) == 7 and "losing to fixed merge" in d.reason
    assert policy.stats.as_dict()["learning"]["observed"] == 4
    policy.reset()
    assert policy.guard.active is None and policy.costs.observed == 0
    plain = build_policy("v_lora", p, {"learn": False, "guard": False})
    assert plain.costs is p and plain.guard is None


# ---- the simulator: profiled on one device, served on another --------------------------------------------
def test_a_policy_profiled_elsewhere_learns_the_devices_costs_and_serves_better():
    """Profiled where LoRA is nearly free, served where it costs 0.03 ms per token: without learning
    the policy runs mostly unmerged; learning from the simulated steps, it merges the
    dominant adapter, predicts the steps within 15% and serves the same trace faster."""
    profiled, device = prefill_heavy(0.0005), prefill_heavy(0.03)
    for p in (profiled, device):  # deLoRA: a dearer launch than ATMM (two adapters' weights read)
        rows, cols = p.lora["delora"].rows, p.lora["delora"].cols
        per_token = p.lora["delora"](1, 2) - p.lora["delora"](1, 1)
        p.lora["delora"] = affine(rows, cols, lambda a, t, k=per_token: 2.0 + k * t)
    trace = generate(WorkloadSpec(rate=12.0, duration_s=12.0, skewness=0.9, num_adapters=4, seed=3))
    sim = SimConfig(max_batch_size=16, max_tokens_per_step=4096)
    fixed = simulate(trace, VLoRAPolicy(profiled, VLoRAConfig(learn=False, guard=False)), device, sim)
    learner = VLoRAPolicy(profiled, VLoRAConfig(learn_window=200))
    learnt = simulate(trace, learner, device, sim)
    assert fixed.metrics.completed == learnt.metrics.completed == len(trace) > 100
    assert fixed.mode_ms["unmerge"] > 0.5 * sum(fixed.mode_ms.values())
    assert learnt.mode_ms["merge"] + learnt.mode_ms["mixture"] > 0.5 * sum(learnt.mode_ms.values())
    assert learnt.policy_stats["learning"]["median_abs_rel_err"] < 0.15
    assert learnt.metrics.avg_token_latency_ms < 0.9 * fixed.metrics.avg_token_latency_ms
