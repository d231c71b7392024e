"""Policies on scripted queues: V-LoRA follows Algorithm 1, each baseline its own rule."""

from __future__ import annotations

import pytest
from orchestrator_cases import affine, linear_profile, req, view

from serve.orchestrator import Decision, Mode, Policy, VLoRAConfig, VLoRAPolicy, build_policy
from serve.orchestrator.base import BatchEstimate


@pytest.fixture
def profile():
    return linear_profile()


def a_queue(n: int = 6, start: float = 0.0, prompt: int = 100):
    return [req(f"a{i}", "a", start + i, prompt) for i in range(n)]


# ---- modes -----------------------------------------------------------------------------------
def test_modes_say_what_they_can_run_and_what_needs_lora():
    assert Mode.merge("a").can_run("a") and not Mode.merge("a").can_run("b") and not Mode.merge("a").can_run(None)
    assert Mode.mixture("a").can_run("b") and Mode.mixture("a").can_run(None) and Mode.unmerge().can_run("b")
    assert not Mode.mixture("a").needs_lora("a") and Mode.mixture("a").needs_lora(None)  # deLoRA: -dW_a
    assert Mode.unmerge().needs_lora("a") and not Mode.unmerge().needs_lora(None)
    assert str(Mode.mixture("x")) == "mixture(x)" and Mode.merge("x").merged_adapter == "x"
    with pytest.raises(ValueError, match="needs an adapter"):
        Mode("merge")
    with pytest.raises(ValueError, match="not one of"):
        Mode("fused", "a")


# ---- Algorithm 1 -------------------------------------------------------------------------------
def test_one_dominant_adapter_and_nobody_starving_merges_it(profile):
    policy = VLoRAPolicy(profile, PAPER)
    d = policy.decide(view(10.0, a_queue() + [req("b0", "b", 4.0)]))
    assert d.mode == Mode.merge("a") and d.switch and d.starving == 0
    assert d.admit == ("a0", "a1", "a2", "a3", "a4", "a5"), "only the merged adapter's requests, in arrival order"
    assert d.reason.startswith("merge:")


ALG1 = VLoRAConfig(decide="algorithm1", mixture_by_cost=False)  # Algorithm 1's rule alone (the profile's veto is tested apart)
PAPER = VLoRAConfig(decide="algorithm1")  # Algorithm 1 with the profile veto on mixture, no backfill


def test_a_few_starving_requests_join_the_merged_adapter_through_mixture(profile):
    policy = VLoRAPolicy(profile, ALG1)  # tolerance 0.5 x default target 5000 ms: starving past a 2500 ms credit
    old = [req("b-old", "b", -3000.0), req("c-old", None, -2900.0)]
    # long prompts of `a`: deLoRA over the two starving costs less than ATMM over everyone
    d = policy.decide(view(10.0, a_queue(prompt=1000) + [req("b-new", "b", 5.0)] + old))
    assert d.mode == Mode.mixture("a") and d.starving == 2
    assert d.admit == ("b-old", "c-old", "a0", "a1", "a2", "a3", "a4", "a5"), "starving first, then R_merge"
    assert "b-new" not in d.admit


def test_mixture_dearer_than_unmerge_in_the_profile_unmerges(profile):
    """Where the LoRA branch costs about the same for any number of tokens (launch-bound decode),
    deLoRA's second pass makes mixture dearer than unmerge: the measured profile decides."""
    launch_bound = linear_profile()
    rows, cols = launch_bound.lora["atmm"].rows, launch_bound.lora["atmm"].cols
    launch_bound.lora["atmm"] = affine(rows, cols, lambda a, t: 1.0 + 0.0 * t)
    launch_bound.lora["delora"] = affine(rows, cols, lambda a, t: 2.0 + 0.0 * t)
    # b-run has 97 tokens to go: the two switches (5 ms each) spread over them cost less than deLoRA's 1 ms a step
    running = [req("b-run", "b", -50.0, out=100, computed_tokens=100, generated_tokens=3)]
    queue = [req(f"a{i}", "a", float(i), computed_tokens=100, generated_tokens=1) for i in range(6)]
    d = VLoRAPolicy(launch_bound, PAPER).decide(view(10.0, [], queue + running, mode=Mode.merge("a")))
    assert d.mode == Mode.unmerge() and d.switch and "per step (profile)" in d.reason
    d = VLoRAPolicy(launch_bound, VLoRAConfig(decide="algorithm1", mixture_by_cost=False)).decide(
        view(10.0, [], queue + running, mode=Mode.merge("a")))
    assert d.mode == Mode.mixture("a") and not d.switch  # Algorithm 1 alone keeps the merged weights
    # the same batch with the profile's deLoRA as cheap as ATMM per token: mixture, no switch
    d = VLoRAPolicy(profile, PAPER).decide(view(10.0, [], queue + running, mode=Mode.merge("a")))
    assert d.mode == Mode.mixture("a") and not d.switch


def test_more_starving_than_half_the_batch_unmerges(profile):
    policy = VLoRAPolicy(profile, PAPER)
    starving = [req(f"s{i}", f"x{i}", -4000.0 + i) for i in range(5)]  # 5 > 0.5 * MaxBS 8
    d = policy.decide(view(10.0, a_queue() + starving, mode=Mode.merge("a")))
    assert d.mode == Mode.unmerge() and d.switch and d.starving == 5
    assert d.admit == ("s0", "s1", "s2", "s3", "s4", "a0", "a1", "a2")


def test_no_dominant_adapter_unmerges_first_come_first_served(profile):
    queue = [req("a0", "a", 0), req("b0", "b", 1), req("c0", "c", 2), req("a1", "a", 3), req("b1", "b", 4)]
    d = VLoRAPolicy(profile, PAPER).decide(view(10.0, queue))
    assert d.mode == Mode.unmerge() and not d.switch
    assert d.admit == ("a0", "b0", "c0", "a1", "b1") and d.reason.startswith("unmerge: not dominated")


def test_running_requests_of_other_adapters_keep_running_in_mixture_not_paused(profile):
    running = [req("b-run", "b", -50.0, computed_tokens=100, generated_tokens=3)]
    d = VLoRAPolicy(profile, ALG1).decide(view(10.0, a_queue(prompt=1000), running))
    assert d.mode == Mode.mixture("a") and d.pause == ()
    assert d.admit == ("a0", "a1", "a2", "a3", "a4", "a5") and "finish" in d.reason


def test_dominance_counts_against_the_max_batch_or_the_requests_present(profile):
    queue = a_queue(3)
    assert VLoRAPolicy(profile, PAPER).decide(view(10.0, queue)).mode == Mode.unmerge(), "3 <= 0.5 * MaxBS 8"
    present = VLoRAPolicy(profile, VLoRAConfig(decide="algorithm1", share_of="present"))
    assert present.decide(view(10.0, queue)).mode == Mode.merge("a"), "3 > 0.5 * min(8, 3)"


def test_a_tie_of_equal_arrivals_goes_to_the_adapter_whose_request_fcfs_puts_first(profile):
    # a burst: every request arrived at the same ms, as a replayed trace's do; fcfs orders them by id,
    # and so must the choice of the most requested adapter (never the adapters' names)
    queue = [req("r0", "zebra", 0.0), req("r1", "apple", 0.0), req("r2", "zebra", 0.0), req("r3", "apple", 0.0)]
    policy = VLoRAPolicy(profile, VLoRAConfig(decide="algorithm1", share_of="present"))
    assert policy._top(queue, None)[1] == "zebra"
    assert policy._top(list(reversed(queue)), None)[1] == "zebra", "not the order they are listed in"
    assert policy._top(queue, "apple")[1] == "apple", "the merged adapter still wins its tie"
    later = [req("r0", "zebra", 2.0), *queue[1:]]  # zebra's first request now arrived after apple's
    assert policy._top(later, None)[1] == "apple"


def test_the_merged_adapter_keeps_its_place_within_the_hysteresis_band(profile):
    queue = a_queue(4) + [req("b0", "b", 5), req("c0", "c", 6)]  # a holds 4 of MaxBS 8
    assert VLoRAPolicy(profile, PAPER).decide(view(10.0, queue)).mode == Mode.unmerge(), "entering needs > 4"
    d = VLoRAPolicy(profile, PAPER).decide(view(10.0, queue, mode=Mode.merge("a")))
    assert d.mode == Mode.merge("a") and not d.switch, "staying needs > (0.5 - 0.1) * 8"


def test_credit_is_wait_plus_execution_in_the_current_mode_plus_switch(profile):
    running = [req("x-run", "x", -100.0, computed_tokens=100, generated_tokens=2), req("base-run", None, -90.0)]
    waiting = [req("w", "a", 0.0, prompt=300, out=20)]
    p = profile
    unmerge = VLoRAPolicy(p, PAPER).credits(view(40.0, waiting, running))["w"]
    # 3 sequences; LoRA over x-run's token and w's tokens, adapters {x, a}
    expect = 40.0 + p.step_ms(3, 302, 301, 2, "atmm") + 19 * p.step_ms(3, 3, 2, 2, "atmm")
    assert unmerge == pytest.approx(expect)
    mixture = VLoRAPolicy(p, PAPER).credits(view(40.0, waiting, running, Mode.mixture("x")))["w"]
    # x-run is merged (no LoRA); base-run pays -dW_x, w pays -dW_x + dW_a: adapters {x, a}, deLoRA
    expect = 40.0 + p.step_ms(3, 302, 301, 2, "delora") + 19 * p.step_ms(3, 3, 2, 2, "delora")
    assert mixture == pytest.approx(expect)
    merged = VLoRAPolicy(p, PAPER).credits(view(40.0, waiting, running[:1], Mode.merge("x")))["w"]
    # w cannot run merged: estimated unmerged after a switch (one all-layer unmerge, 5 ms)
    expect = 40.0 + p.step_ms(2, 301, 301, 2, "atmm") + 19 * p.step_ms(2, 2, 2, 2, "atmm") + 5.0
    assert merged == pytest.approx(expect)


def test_alike_requests_share_one_estimate_and_each_credit_is_still_its_own(profile):
    # a flood's requests are alike: their estimate is made once; each credit keeps its own wait
    running = [req("x-run", "x", -100.0, computed_tokens=100, generated_tokens=2)]
    waiting = [req(f"f{i}", "a", float(i), prompt=30, out=1) for i in range(20)]
    waiting += [req("long", "a", 3.0, prompt=30, out=40), req("base", None, 4.0, prompt=300),
                req("head", "a", 5.0, prompt=30, out=1, output_mode="head"),
                req("part", "a", 6.0, prompt=300, computed_tokens=200), req("other", "b", 7.0, prompt=30, out=1)]
    policy = VLoRAPolicy(profile, PAPER)
    for mode in (Mode.unmerge(), Mode.merge("a")):
        got = policy.credits(view(50.0, waiting, running, mode))
        here = BatchEstimate(profile, mode, policy.lora_op, running)
        away = BatchEstimate(profile, Mode.unmerge(), policy.lora_op, running)
        switch = profile.switch_cost_ms(policy.switch_op, mode.merged_adapter, None)
        for r in waiting:
            one = here.exec_ms(r) if mode.can_run(r.adapter) else away.exec_ms(r) + switch
            assert got[r.request_id] == pytest.approx(50.0 - r.arrival_ms + one), (mode, r.request_id)
        assert len({got[f"f{i}"] + i for i in range(20)}) == 1  # alike: the same estimate, their own waits


def test_application_targets_and_priorities_set_the_starving_threshold(profile):
    policy = VLoRAPolicy(profile, VLoRAConfig(decide="algorithm1", tolerance=0.5, mixture_by_cost=False))
    video = req("v", "b", 0.0, app="video", slo_ms=1000.0, priority=2.0)
    retrieval = req("r", "b", 0.0, app="retrieval", slo_ms=1000.0)
    assert policy.threshold_ms(video) == 250.0 and policy.threshold_ms(retrieval) == 500.0
    assert policy.threshold_ms(req("n", "b", 0.0)) == 2500.0, "no target: default_slo_ms"
    # wait 300 ms + ~140 ms execution: over the video threshold, under the retrieval one
    d = policy.decide(view(300.0, a_queue(6, start=290.0) + [retrieval, video]))
    assert d.mode == Mode.mixture("a") and d.starving == 1 and d.admit[0] == "v" and "r" not in d.admit


def test_a_switch_is_followed_by_a_dwell_that_holds_the_weights(profile):
    policy = VLoRAPolicy(profile, PAPER)  # switch 5 ms, at most 10% switching: dwell 45 ms
    assert policy.dwell_ms() == pytest.approx(45.0)
    d1 = policy.decide(view(0.0, a_queue()))
    assert d1.mode == Mode.merge("a") and d1.switch
    b_queue = [req(f"b{i}", "b", 1.0 + i) for i in range(6)] + [req("a9", "a", 2.5)]
    d2 = policy.decide(view(20.0, b_queue, mode=Mode.merge("a")))
    assert d2.mode == Mode.mixture("a") and not d2.switch and d2.reason.startswith("dwell:")
    assert d2.admit == ("b0", "b1", "a9", "b2", "b3", "b4", "b5"), "the hold runs everyone, first come first served"
    d3 = policy.decide(view(50.0, b_queue, mode=Mode.mixture("a")))
    assert d3.mode == Mode.merge("b") and d3.switch
    assert policy.stats.switches == 2 and policy.stats.switch_ms == pytest.approx(5.0 + 10.0), "a->b: unmerge + merge"
    assert policy.stats.steps_by_mode == {"unmerge": 0, "merge": 2, "mixture": 1}
    assert [r.switch for r in policy.log] == [True, False, True] and policy.stats.reasons["dwell"] == 1


def test_idle_keeps_the_mode(profile):
    d = VLoRAPolicy(profile, PAPER).decide(view(0.0, mode=Mode.merge("a")))
    assert d.mode == Mode.merge("a") and not d.switch and d.reason == "idle"


def test_a_policy_that_admits_what_its_mode_cannot_run_is_stopped(profile):
    class Broken(Policy):
        name = "broken"

        def _decide(self, v):
            return Decision(Mode.merge("a"), tuple(r.request_id for r in v.waiting))

    with pytest.raises(RuntimeError, match=r"\['b0'\] cannot run in mode merge\(a\)"):
        Broken(profile).decide(view(0.0, [req("a0", "a", 0), req("b0", "b", 0)]))


# ---- baselines ---------------------------------------------------------------------------------
def test_unmerge_only_always_unmerges_in_arrival_order(profile):
    policy = build_policy("unmerge_only", profile)
    queue = [req("b0", "b", 2), req("x0", "x", 1)] + a_queue(8, start=3)
    d = policy.decide(view(5.0, queue, mode=Mode.merge("a")))
    assert d.mode == Mode.unmerge() and d.switch and d.admit[:2] == ("x0", "b0") and len(d.admit) == 8
    assert policy.lora_op == "atmm"


def test_fcfs_keeps_the_mode_and_the_arrival_order(profile):
    policy = build_policy("fcfs", profile)
    d = policy.decide(view(5.0, [req("b0", "b", 2), req("n0", None, 1)]))
    assert d.mode == Mode.unmerge() and not d.switch and d.admit == ("n0", "b0")


def test_merge_only_serves_one_adapter_drains_then_turns_to_the_oldest(profile):
    policy = build_policy("merge_only", profile, {"max_wait_ms": 2000.0})
    d = policy.decide(view(10.0, [req("a0", "a", 0), req("b0", "b", 1), req("a1", "a", 2)]))
    assert d.mode == Mode.merge("a") and d.switch and d.admit == ("a0", "a1")
    running = [req("a0", "a", 0, computed_tokens=100)]
    d = policy.decide(view(100.0, [req("b0", "b", 1)], running, Mode.merge("a")))
    assert d.mode == Mode.merge("a") and d.admit == () and d.reason.startswith("drain")
    d = policy.decide(view(200.0, [req("b0", "b", 1), req("a2", "a", 150)], (), Mode.merge("a")))
    assert d.mode == Mode.merge("a") and d.admit == ("a2",), "the merged adapter still has requests"
    d = policy.decide(view(2500.0, [req("b0", "b", 1), req("a3", "a", 2400)], running, Mode.merge("a")))
    assert d.admit == () and "overdue" in d.reason, "b0 waited 2.5 s: stop admitting a, drain"
    d = policy.decide(view(2600.0, [req("b0", "b", 1), req("a3", "a", 2400)], (), Mode.merge("a")))
    assert d.mode == Mode.merge("b") and d.admit == ("b0",)


def test_dlora_merges_by_throughput_pauses_others_and_unmerges_when_overdue(profile):
    policy = build_policy("dlora", profile)
    assert (policy.lora_op, policy.switch_op) == ("einsum", "addmm")
    d = policy.decide(view(10.0, a_queue()))
    assert d.mode == Mode.merge("a") and d.switch
    running = [req("b-run", "b", 0.0, computed_tokens=100)]
    d = policy.decide(view(20.0, a_queue(), running, Mode.merge("a")))
    assert d.mode == Mode.merge("a") and d.pause == ("b-run",) and len(d.admit) == 6
    d = policy.decide(view(2030.0, a_queue(), running, Mode.merge("a")))
    assert d.mode == Mode.unmerge() and d.pause == () and "overdue" in d.reason, "b-run paused for 2 s"
    even = [req(f"{x}{i}", x, i) for i in range(2) for x in "abc"]
    d = policy.decide(view(10.0, even))
    assert d.mode == Mode.unmerge() and d.reason.startswith("unmerge:") and len(d.admit) == 6


def test_build_policy_names_what_is_valid(profile):
    with pytest.raises(ValueError, match="unknown policy 'lru'"):
        build_policy("lru", profile)
    with pytest.raises(ValueError, match=r"no parameter\(s\) \['tolerence'\]"):
        build_policy("v_lora", profile, {"tolerence": 0.3})
    with pytest.raises(ValueError, match="disagrees"):
        build_policy("v_lora", profile, {"name": "dlora"})
    with pytest.raises(ValueError, match="share_of"):
        build_policy("v_lora", profile, {"share_of": "queue"})
    profile.lora.pop("einsum")
    with pytest.raises(ValueError, match="needs LoRA op"):
        build_policy("dlora", profile)


def test_backfill_admits_other_adapters_instead_of_holding_them(profile):
    queue = a_queue(prompt=1000) + [req("b0", "b", 4.0), req("c0", None, 5.0)]
    held = VLoRAPolicy(profile, PAPER).decide(view(10.0, queue))
    assert held.mode == Mode.merge("a") and "b0" not in held.admit  # Algorithm 1: b0 waits until it starves
    d = VLoRAPolicy(profile, VLoRAConfig(decide="algorithm1", backfill=True, mixture_by_cost=False)).decide(view(10.0, queue))
    assert d.mode == Mode.mixture("a") and d.admit == ("a0", "a1", "a2", "a3", "a4", "b0", "a5", "c0")  # arrival order
    assert "backfill" in d.reason
    alone = VLoRAPolicy(profile, VLoRAConfig(decide="algorithm1", backfill=True)).decide(view(10.0, a_queue()))
    assert alone.mode == Mode.merge("a")  # nobody else present: merged, no LoRA work at all


# ---- decisions from the cost model (decide="cost", the default) --------------------------------
def test_cost_holds_other_adapters_when_the_dominant_one_fills_the_batch(profile):
    policy = VLoRAPolicy(profile)
    queue = a_queue(10) + [req("b0", "b", 4.5)]  # 10 of a for a batch of 8
    d = policy.decide(view(10.0, queue))
    assert d.mode == Mode.merge("a") and d.switch and "b0" not in d.admit and len(d.admit) == 8
    assert d.reason.startswith("hold(a): cheapest per token")
    # the choice is the cheapest of the plans the profile prices
    everyone = [r for r in sorted(queue, key=lambda r: r.arrival_ms)]
    v = view(10.0, queue)
    hold = policy.hold_cost(v, "a", [r for r in everyone if r.adapter == "a"])
    assert hold == policy.plan_cost(v, Mode.mixture("a"), [r for r in everyone if r.adapter == "a"], merged_only=True)
    assert hold < policy.plan_cost(v, Mode.unmerge(), everyone) and hold < policy.plan_cost(v, Mode.mixture("a"), everyone)


def test_cost_never_holds_a_starving_request(profile):
    policy = VLoRAPolicy(profile)  # default target 5000 ms x tolerance 0.5: starving past 2500 ms
    d = policy.decide(view(10.0, a_queue(10) + [req("b-old", "b", -3000.0)]))
    assert d.starving == 1 and d.admit[0] == "b-old" and d.mode.kind in ("mixture", "unmerge")
    assert "hold(" not in d.reason.split(":")[0]


def test_cost_keeps_a_small_mixed_batch_unmerged(profile):
    """Two of a and one of b: holding b halves the batch and merging costs a switch; unmerge is cheapest."""
    d = VLoRAPolicy(profile).decide(view(10.0, [req("a0", "a", 0), req("b0", "b", 1), req("a1", "a", 2)]))
    assert d.mode == Mode.unmerge() and not d.switch and d.admit == ("a0", "b0", "a1")
    assert d.reason.startswith("unmerge: cheapest per token")


def test_cost_picks_mixture_or_unmerge_by_the_profile(profile):
    """Merged a with a long-running request of b: mixture keeps the weights when deLoRA is cheap; where
    deLoRA costs more than ATMM for the same tokens (a launch-bound profile), it unmerges."""
    running = [req("b-run", "b", -50.0, out=100, computed_tokens=100, generated_tokens=3)]
    running += [req(f"a{i}", "a", float(i), out=100, computed_tokens=100, generated_tokens=1) for i in range(6)]
    d = VLoRAPolicy(profile).decide(view(10.0, [], running, mode=Mode.merge("a")))
    assert d.mode == Mode.mixture("a") and not d.switch
    dear = linear_profile()
    rows, cols = dear.lora["atmm"].rows, dear.lora["atmm"].cols
    dear.lora["delora"] = affine(rows, cols, lambda a, t: 6.0 + 0.0 * t)  # 6 ms against ATMM's 2.5-3 ms
    d = VLoRAPolicy(dear).decide(view(10.0, [], running, mode=Mode.merge("a")))
    assert d.mode == Mode.unmerge() and d.switch and d.reason.startswith("unmerge:")


def test_cost_merged_weights_stay_merged_once_the_others_finish(profile):
    """hold(a) with b still running is mixture(a) (b is never paused); once b is gone, merge(a)."""
    policy = VLoRAPolicy(profile)
    b_run = req("b-run", "b", -50.0, out=10, computed_tokens=100, generated_tokens=8)
    d = policy.decide(view(10.0, a_queue(10) + [req("b1", "b", 3.5)], [b_run], mode=Mode.mixture("a")))
    assert d.mode == Mode.mixture("a") and d.pause == () and "b1" not in d.admit
    d = policy.decide(view(30.0, a_queue(10) + [req("b1", "b", 3.5)], mode=Mode.mixture("a")))
    assert d.mode == Mode.merge("a") and not d.switch


def test_paper_config_is_algorithm_one_as_printed(profile):
    policy = build_policy("v_lora_paper", profile)
    assert policy.name == "v_lora_paper" and policy.config.decide == "algorithm1"
    assert not policy.config.backfill and not policy.config.mixture_by_cost
    d = policy.decide(view(10.0, a_queue() + [req("b0", "b", 4.0)]))
    assert d.mode == Mode.merge("a") and d.reason.startswith("merge:")
    with pytest.raises(ValueError, match="decide 'greedy' is not one of"):
        VLoRAConfig(decide="greedy")
    atmm = build_policy("dlora_atmm", profile)
    assert (atmm.name, atmm.lora_op, atmm.switch_op) == ("dlora_atmm", "atmm", "atmm")
