"""What the simulator adds to the profile's step times to stand for a GPU's engine: host work, the
vision tower, seeded noise, stalls at a given time, slow spikes and kernels compiled on first use."""

from __future__ import annotations

import pytest
from orchestrator_cases import linear_profile, req

from serve.orchestrator import Mode, build_policy
from serve.sim import SimConfig, simulate


def _steps(config: SimConfig, trace=None):
    p = linear_profile()
    trace = trace or [req("r", "a", 0.0, prompt=300, out=5, image_tokens=200)]
    return p, simulate(trace, build_policy("unmerge_only", p), p, config)


def test_host_work_and_the_vision_tower_are_added_to_the_steps_that_pay_them():
    p, res = _steps(SimConfig(keep_timeline=True, host_ms=2.0, image_ms_per_ktoken=10.0))
    prefill, decode = p.batch_ms(Mode.unmerge(), [("a", 300)]), p.batch_ms(Mode.unmerge(), [("a", 1)])
    # the images lead the prompt: the prefill step encodes all 200 image tokens, the decode steps none
    assert [s.step_ms for s in res.timeline] == pytest.approx([prefill + 2.0 + 2.0] + [decode + 2.0] * 4)


def test_a_stall_lands_on_the_first_step_at_or_after_its_time_and_the_first_use_of_a_kind_pays_once():
    p, plain = _steps(SimConfig(keep_timeline=True))
    start = [s.start_ms for s in plain.timeline]
    _, stalled = _steps(SimConfig(keep_timeline=True, stalls=[(start[2] - 0.5, 100.0)]))
    assert [b.step_ms - a.step_ms for a, b in zip(plain.timeline, stalled.timeline)] == pytest.approx(
        [0, 0, 100.0, 0, 0])
    # two kinds of step here: an ATMM prefill, then ATMM decode steps
    _, compiled = _steps(SimConfig(keep_timeline=True, first_use_ms=50.0))
    assert [b.step_ms - a.step_ms for a, b in zip(plain.timeline, compiled.timeline)] == pytest.approx(
        [50.0, 50.0, 0, 0, 0])


def test_noise_and_spikes_are_seeded():
    trace = [req(f"r{i}", "a", 10.0 * i, prompt=50, out=20) for i in range(20)]
    runs = [_steps(SimConfig(keep_timeline=True, step_noise=0.2, spike_share=0.3, spike_ms=30.0, noise_seed=s),
                   trace)[1] for s in (1, 1, 2)]
    times = [[s.step_ms for s in r.timeline] for r in runs]
    assert times[0] == times[1] and times[0] != times[2]
    _, plain = _steps(SimConfig(keep_timeline=True), trace)
    typical = max(s.step_ms for s in plain.timeline)
    assert max(times[0]) > typical + 20 and min(times[0]) < typical  # spikes of 30 ms; noise both ways


@pytest.mark.parametrize("bad", [dict(step_noise=-0.1), dict(host_ms=float("nan")), dict(spike_share=1.5),
                                 dict(stalls=[(0.0, -1.0)])])
def test_impossible_device_costs_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SimConfig(**bad)
