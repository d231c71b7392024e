"""The step planner hands a learning policy what each step ran: its batch, the image tokens it
prefilled, its measured time and the switches applied before it (torch-free: the simulator's
switcher stands in for the adapter manager)."""

from __future__ import annotations

import pytest

from serve.engine.block_manager import BlockManager
from serve.engine.planner import StepPlanner, request_view, step_image_tokens
from serve.engine.scheduler import Scheduler, SchedulerConfig
from serve.engine.sequence import MMSpan, Sequence
from serve.orchestrator import Mode, VLoRAConfig, VLoRAPolicy, assumed_profile
from serve.sim.simulate import _ProfileSwitcher


def seq(rid, adapter, prompt=100, spans=(), out=4):
    return Sequence(rid, list(range(prompt)), out, adapter=adapter, mm_spans=tuple(spans))


def test_request_views_count_the_image_tokens_still_to_prefill():
    s = seq("r", "a", 600, [MMSpan(10, 266, "x"), MMSpan(300, 556, "y")])
    assert request_view(s).image_tokens == 512
    s.num_computed_tokens = 200  # half of x's tokens computed already
    assert request_view(s).image_tokens == 66 + 256
    s.num_computed_tokens = 600
    assert request_view(s).image_tokens == 0


def test_a_steps_image_tokens_are_the_images_it_reached_first():
    s = seq("r", "a", 600, [MMSpan(10, 266, "x"), MMSpan(300, 556, "y")])
    s.num_computed_tokens = 256  # after a 256-token chunk: x (starts at 10) was encoded for it
    assert step_image_tokens([(s, 256)]) == 256
    s.num_computed_tokens = 600  # the next chunk reached y
    assert step_image_tokens([(s, 344)]) == 256
    assert step_image_tokens([(seq("t", None), 1)]) == 0


def test_observe_step_hands_the_policy_the_step_and_the_switch_before_it():
    profile = assumed_profile()
    policy = VLoRAPolicy(profile, VLoRAConfig(max_switch_share=1.0))
    sched = Scheduler(SchedulerConfig(4, 4096, True, 2048), BlockManager(512, 16, enable_prefix_cache=False))
    planner = StepPlanner(policy, sched, _ProfileSwitcher(profile, "atmm", None), 4, 4096, clock=lambda: 0.0)
    for i in range(4):
        sched.add(seq(f"a{i}", "a", 300, [MMSpan(0, 256, f"k{i}")]))
    batch = sched.schedule(planner.plan())
    assert planner.mode == Mode.merge("a") and planner.stats.switches == 1
    sched.postprocess(batch, {s.seq_id: 7 for s, _ in batch.entries})
    seen = []
    policy.observe = lambda *args: seen.append(args)
    planner.observe_step(batch, 0.120)
    mode, entries, ms, images, switch_ms, folds = seen[0]
    assert mode == Mode.merge("a") and entries == [("a", 300)] * 4 and ms == pytest.approx(120.0)
    assert images == 4 * 256 and switch_ms == pytest.approx(profile.switch_ms["atmm"]) and folds == 1
    planner.observe_step(batch, 0.010)  # no switch since: none handed again
    assert seen[1][4:] == (0.0, 0)
