"""Workloads are statistically what they claim (seeded, with tolerances); traces round-trip;
the cost profile interpolates, saves and measures; metrics follow their definitions."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter
from dataclasses import replace

import pytest
from orchestrator_cases import affine, linear_profile

from serve.orchestrator import AppSpec, CostProfile, Mode, ProfileShapes, RequestRecord, WorkloadSpec, \
    adapter_names, generate, measure_profile, percentile, read_trace, summarize, video_analytics, \
    visual_retrieval, write_trace


def _three_sigma(p: float, n: int) -> float:
    return 3 * math.sqrt(p * (1 - p) / n) + 1e-9


@pytest.mark.parametrize("skewness,num_adapters", [(0.1, 16), (0.5, 2), (0.9, 8), (0.6, 128)])
def test_the_most_requested_adapter_takes_the_skewness_share(skewness, num_adapters):
    trace = generate(WorkloadSpec(rate=200.0, duration_s=40.0, skewness=skewness, num_adapters=num_adapters, seed=3))
    counts = Counter(r.adapter for r in trace)
    n = len(trace)
    names = adapter_names(num_adapters)
    assert set(counts) <= set(names)
    assert abs(counts[names[0]] / n - skewness) < _three_sigma(skewness, n)
    rest = (1 - skewness) / (num_adapters - 1)
    others = [counts[a] / n for a in names[1:]]
    assert abs(statistics.mean(others) - rest) < _three_sigma(rest, n)
    if num_adapters <= 16:  # each one on its own: every adapter is used, at its share
        assert all(abs(s - rest) < _three_sigma(rest, n) + 0.01 for s in others) and len(counts) == num_adapters
    else:
        assert len(counts) >= 0.95 * num_adapters


def test_poisson_arrivals_come_at_the_rate_with_exponential_gaps():
    trace = generate(WorkloadSpec(rate=50.0, duration_s=100.0, seed=1))
    gaps = [b.arrival_ms - a.arrival_ms for a, b in zip(trace, trace[1:])]
    n = len(trace)  # ~5000; Poisson count has sd sqrt(5000) ~ 71
    assert abs(n - 5000) < 4 * math.sqrt(5000)
    assert abs(statistics.mean(gaps) - 20.0) < 20.0 * 4 / math.sqrt(n)
    assert abs(statistics.stdev(gaps) / statistics.mean(gaps) - 1.0) < 0.08
    assert all(0 <= r.arrival_ms < 100_000 for r in trace) and min(gaps) >= 0


def test_gamma_arrivals_keep_the_rate_and_take_the_burstiness():
    trace = generate(WorkloadSpec(rate=50.0, duration_s=100.0, arrival="gamma", cv=2.0, seed=2))
    gaps = [b.arrival_ms - a.arrival_ms for a, b in zip(trace, trace[1:])]
    assert abs(statistics.mean(gaps) - 20.0) < 20.0 * 0.1
    assert abs(statistics.stdev(gaps) / statistics.mean(gaps) - 2.0) < 0.25


def test_the_two_applications_have_their_shapes_shares_and_targets():
    spec = WorkloadSpec(rate=100.0, duration_s=30.0, base_share=0.2, seed=4,
                        apps=[video_analytics(0.25), visual_retrieval(0.75)])
    trace = generate(spec)
    video = [r for r in trace if r.app == "video_analytics"]
    retrieval = [r for r in trace if r.app == "visual_retrieval"]
    n = len(trace)
    assert abs(len(video) / n - 0.25) < _three_sigma(0.25, n)
    assert abs(sum(r.adapter is None for r in trace) / n - 0.2) < _three_sigma(0.2, n)
    assert all(4 * 256 + 16 <= r.prompt_tokens <= 8 * 256 + 48 and r.priority == 2.0 for r in video)
    heads = [r for r in video if r.output_mode == "head"]
    assert abs(len(heads) / len(video) - 0.5) < _three_sigma(0.5, len(video))
    assert all(r.output_tokens == 1 for r in heads) and all(r.slo_ms == 1500.0 for r in video)
    assert all(5 <= r.output_tokens <= 10 for r in video if r.output_mode == "generate")
    assert all(256 + 16 <= r.prompt_tokens <= 256 + 48 and 32 <= r.output_tokens <= 256 for r in retrieval)
    assert all(r.slo_ms == 2000.0 + 50.0 * r.output_tokens for r in retrieval)
    assert abs(statistics.mean(r.output_tokens for r in retrieval) - 144) < 5


def test_workloads_are_seeded_and_bad_knobs_are_named():
    spec = WorkloadSpec(rate=20.0, duration_s=5.0, seed=9)
    assert generate(spec) == generate(spec) and generate(spec) != generate(replace(spec, seed=10))
    with pytest.raises(ValueError, match=r"skewness 0.1 must lie in \[1/num_adapters, 1\] = \[0.125, 1\]"):
        WorkloadSpec(skewness=0.1, num_adapters=8)
    with pytest.raises(ValueError, match="arrival 'uniform' is not one of"):
        WorkloadSpec(arrival="uniform")
    with pytest.raises(ValueError, match="frames must be an inclusive range"):
        AppSpec("x", 1.0, frames=(3, 2))


def test_traces_round_trip_and_user_traces_are_checked(tmp_path):
    spec = WorkloadSpec(rate=30.0, duration_s=5.0, base_share=0.1, seed=5)
    trace = generate(spec)
    path = write_trace(tmp_path / "t.jsonl", trace, spec)
    assert read_trace(path) == trace
    assert json.loads(path.read_text().splitlines()[0])["spec"]["rate"] == 30.0
    # a user's own trace: no header, optional fields left out, any order
    own = tmp_path / "own.jsonl"
    own.write_text('{"request_id": "q2", "arrival_ms": 50, "adapter": null, "prompt_tokens": 300, '
                   '"output_tokens": 40}\n\n{"request_id": "q1", "arrival_ms": 10, "adapter": "det", "prompt_tokens": 1500, '
                   '"output_tokens": 1, "output_mode": "head", "app": "video_analytics", "slo_ms": 800}\n')
    got = read_trace(own)
    assert [r.request_id for r in got] == ["q1", "q2"] and got[0].output_mode == "head" and got[1].slo_ms is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"request_id": "q", "arrival_ms": 0, "adapter": "a", "prompt": 3, "output_tokens": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing \['prompt_tokens'\], unknown \['prompt'\]"):
        read_trace(bad)
    bad.write_text('{"request_id": "q", "arrival_ms": 0, "adapter": "a", "prompt_tokens": 0, "output_tokens": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: .*prompt_tokens must be >= 1"):
        read_trace(bad)


# ---- cost profile ------------------------------------------------------------------------------
def test_profile_grids_interpolate_clamp_and_extrapolate():
    g = affine([1, 8, 32], [1, 64, 1024], lambda s, t: 10 + 0.5 * s + 0.01 * t)
    assert g(8, 64) == pytest.approx(14.64)
    assert g(20, 500) == pytest.approx(10 + 10 + 5), "bilinear is exact for affine costs"
    assert g(0.5, 0) == pytest.approx(g(1, 1)), "clamped below the first point"
    assert g(64, 4096) == pytest.approx(10 + 32 + 40.96), "extrapolated past the last"
    with pytest.raises(ValueError, match="strictly increasing"):
        affine([1, 1], [1], lambda s, t: 0)


def test_profile_prices_steps_per_mode_and_switches(tmp_path):
    p = linear_profile()
    batch = [("a", 100), ("a", 1), ("b", 1), (None, 1)]
    base = 10 + 0.01 * 103 + 0.1 * 4
    assert p.batch_ms(Mode.merge("a"), batch[:2]) == pytest.approx(base - 0.02 - 0.2), "merged: no LoRA work"
    assert p.batch_ms(Mode.unmerge(), batch) == pytest.approx(base + 2 + 0.5 * 2 + 0.001 * 102)
    assert p.batch_ms(Mode.mixture("a"), batch) == pytest.approx(base + 2 + 0.5 * 2 + 0.002 * 2), \
        "mixture: b and the base request through deLoRA, adapters {a, b}"
    assert p.batch_ms(Mode.unmerge(), batch, "einsum") == pytest.approx(base + 8 + 4 + 0.004 * 102)
    assert p.switch_cost_ms("atmm", None, "a") == 5.0 and p.switch_cost_ms("atmm", "a", "b") == 10.0
    assert p.switch_cost_ms("addmm", "a", None) == 50.0 and p.switch_cost_ms("atmm", "a", "a") == 0.0
    assert CostProfile.load(p.save(tmp_path / "p.json")) == p
    (tmp_path / "broken.json").write_text('{"base": {}}')
    with pytest.raises(ValueError, match="cannot read cost profile"):
        CostProfile.load(tmp_path / "broken.json")


def test_measure_profile_times_the_callables_it_is_given():
    def step(shape):  # a stand-in engine step whose cost depends on the shape (sleeps: robust to a busy CPU)
        time.sleep((2.0 + 0.05 * shape.tokens + (4.0 if shape.lora_op else 0.0)) / 1e3)

    switches = []
    p = measure_profile(step, lambda op: (switches.append(op), time.sleep(0.010)),
                        ProfileShapes(seqs=[1, 4], tokens=[4, 100], adapters=[1, 2], lora_ops=["atmm"],
                                      switch_ops=["atmm"]), warmup=1, repeats=5)
    assert not p.assumed and sorted(p.lora) == ["atmm"] and switches == ["atmm"] * 6
    # a sleep lasts at least as long as asked; wake-up latency on a loaded machine adds a little
    assert 7.0 <= p.base(1, 100) < 7.0 * 1.3 + 2 and 2.2 <= p.base(4, 4) < 2.2 * 1.3 + 2
    assert p.lora_ms("atmm", 2, 100) == pytest.approx(4.0, abs=2.0)
    assert 5.0 <= p.switch_ms["atmm"] < 5.0 * 1.3 + 2, "a merge + unmerge round trip, halved"


# ---- metrics -----------------------------------------------------------------------------------
def test_metrics_follow_their_definitions():
    recs = [RequestRecord("a", "video", "x", 0.0, 1000, 1, slo_ms=500.0, first_scheduled_ms=10.0, finish_ms=400.0),
            RequestRecord("b", "retr", "y", 100.0, 300, 99, slo_ms=2500.0, first_scheduled_ms=300.0, finish_ms=3100.0),
            RequestRecord("c", "retr", None, 200.0, 300, 50)]  # never finished
    m = summarize(recs, switches=3, switch_ms=15.0)
    assert m.avg_token_latency_ms == pytest.approx((400 + 3000) / 100), "sum of latencies / generated tokens"
    assert summarize(recs, tokens="all").avg_token_latency_ms == pytest.approx(3400 / 1400)
    assert (m.requests, m.completed, m.switches, m.switch_ms) == (3, 2, 3, 15.0)
    assert m.slo_attainment == 0.5 and m.max_wait_ms == 200.0 and m.avg_wait_ms == 105.0
    assert m.throughput_rps == pytest.approx(2 / 3.1) and m.throughput_tps == pytest.approx(100 / 3.1)
    assert m.per_app["video"]["slo_attainment"] == 1.0 and m.per_app["retr"] == {
        "completed": 1, "avg_token_latency_ms": 3000 / 99, "p95_ms": 3000.0, "slo_attainment": 0.0}
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5.0], 99) == 5.0 and math.isnan(percentile([], 50))
    assert percentile(list(range(101)), 95) == 95
