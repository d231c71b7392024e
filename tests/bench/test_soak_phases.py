"""The soak's chosen phases (`bench.soak.phases`) and each flood's account of where the victim's time
went (the final event's `timing.pipe_ms` among it: its way from the engine process to the front end),
against a real `vlora serve` on CPU. Times are not asserted (a shared machine's noise would
decide them), only that the parts are there and add up."""

from __future__ import annotations

import json

import pytest

from bench.soak import read_probes
from bench.soak_floods import PARTS, PHASE_PARTS, STEP_PARTS, ratio_interval
from serve.engine.request import STEP_PHASES
from vlora.commands.bench import run
from vlora.config import compose


def test_each_floods_window_after_is_the_next_floods_window_before_and_the_last_has_its_own():
    from bench.soak_floods import _quiet_after

    def window(p95):
        return {"n": 5, "p95_ms": p95}

    # three floods in the order they ran; nobody answered alone before c
    out = {"a": {"quiet": window(10.0), "probe": window(18.0)}, "b": {"quiet": window(12.5), "probe": window(30.0)},
           "c": {"quiet": None, "probe": window(20.0)}}
    _quiet_after(out, window(8.0))  # the window after the last

    def after(name):
        return out[name]["quiet_after"], out[name]["drift"], out[name]["ratio_to_quiet_after"]

    assert after("a") == (window(12.5), 1.25, 1.44)
    assert after("b") == (None, None, None)
    assert after("c") == (window(8.0), None, 2.5)


def test_a_misspelt_phase_is_refused_before_a_server_starts(tmp_path):
    cfg = compose("bench", ["bench.suite=soak", "+bench.soak.phases=[floods,flod]", f"bench.out_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"bench.soak.phases: no phase\(s\) \['flod'\]"):
        run(cfg)
    assert not (tmp_path / "cpu").exists()


def test_a_flood_client_niceness_out_of_range_is_refused_before_a_server_starts(tmp_path):
    cfg = compose("bench", ["bench.suite=soak", "bench.soak.floods_client_nice=-5", f"bench.out_dir={tmp_path}"])
    with pytest.raises(ValueError, match=r"bench.soak.floods_client_nice=-5: give 0-19"):
        run(cfg)
    assert not (tmp_path / "cpu").exists()


def test_only_the_chosen_phases_run_after_the_server_warmed_up_and_each_flood_says_where_the_time_went(
        tiny_zoo, tmp_path):
    cfg = compose("bench", ["bench.suite=soak", "bench.soak.preset=quick", "+bench.soak.phases=[floods]",
                            "bench.soak.quick.floods=[none]", f"bench.soak.checkpoint={tiny_zoo['qwen2_vl_tiny']}",
                            # a server that warms up first, as on a GPU: it refuses work until ready
                            "bench.soak.server_overrides=['engine.warm_up=on']",
                            f"bench.out_dir={tmp_path}"])
    run(cfg)
    report = json.loads((tmp_path / "cpu" / "soak.json").read_text())
    assert "error" not in report["baseline"] and report["baseline"]["latency"]["n"] > 0, report["baseline"]
    assert list(report["phases"]) == ["floods"]
    for name, flood in report["phases"]["floods"]["by_flood"].items():
        assert flood["probe"]["n"] > 0 and flood["quiet"]["n"] > 0, name  # the flood's probes and the quiet ones before
        assert flood["ratio"] == round(flood["probe"]["p95_ms"] / flood["quiet"]["p95_ms"], 2)
        # the probes alone after the flood (the last flood's: one more window) and how far they moved
        after = flood["quiet_after"]
        assert after["n"] > 0 and flood["drift"] == round(after["p95_ms"] / flood["quiet"]["p95_ms"], 2), flood
        assert flood["ratio_to_quiet_after"] == round(flood["probe"]["p95_ms"] / after["p95_ms"], 2)
        lo, hi = flood["ratio_interval"]
        assert lo <= hi and lo > 0, flood["ratio_interval"]
        # each tenant's turns at the server's gate under the flood, read with its own token: the victim's probes
        # went through its gate; nobody was paced with no flood
        assert set(flood["gate"]) == {"victim", "attacker"}, flood["gate"]
        assert flood["gate"]["victim"]["gate_calls"] >= flood["probe"]["n"], flood["gate"]
        assert flood["gate"]["victim"]["gate_paced_ms"] >= 0 and "gate_pace_sleeps" in flood["gate"]["attacker"]
        # the machine's cores while the probes ran: the server's tree answered them, so it used some
        for window, groups in (("cpu", {"server", "flood", "soak", "other"}), ("cpu_quiet", {"server", "soak", "other"})):
            assert set(flood[window]["cores"]) == groups, (name, flood[window])
            assert flood[window]["cores"]["server"] > 0 and flood[window]["window_s"] > 0, (name, flood[window])
        for rows in ("all", "tail"):
            where = flood["where"][rows]
            assert set(where) == {"total_ms", *PARTS, "handoff_ms", "out_ms", *STEP_PARTS, "between_ms", *PHASE_PARTS}
            # the host phases of its first step (prefill) and its last (decode) add up to no more than those steps
            first = sum(where[f"first_{p}_ms"] for p in STEP_PHASES)
            assert 0 < first <= where["first_step_ms"] + 0.01, (name, rows, where)
            assert 0 < sum(where[f"last_{p}_ms"] for p in STEP_PHASES) <= where["last_step_ms"] + 0.01
            # the stepping thread's CPU time in those steps: some, at most their wall (its last step: the decode)
            assert 0 < where["first_step_cpu_ms"] <= where["first_step_ms"] + 0.5
            assert 0 < where["last_step_cpu_ms"] <= where["last_step_ms"] + 0.5 and where["last_step_ms"] < where["step_ms"]
            # the engine's part by where: its steps (a prefill and a decode), their planning, the loop between
            assert where["steps"] >= 2 and 0 < where["first_step_ms"] < where["step_ms"]
            engine = where["step_ms"] + where["plan_ms"] + where["between_ms"]
            assert engine == pytest.approx(where["prefill_ms"] + where["decode_ms"], abs=0.05), (name, rows, where)
            assert where["queue_ms"] + where["prefill_ms"] + where["decode_ms"] > 0
            assert where["pipe_ms"] > 0  # the final's way from the engine process, measured by the front end
            spent = sum(where[k] for k in ("submit_ms", "queue_ms", "prefill_ms", "decode_ms", "after_ms"))
            assert spent == pytest.approx(where["total_ms"], abs=0.1), (name, rows, where)
    # every probe's parts, in a file of their own: they made soak.json 1-2 MB a run
    probes = read_probes(tmp_path / "cpu" / "probes.json.gz")
    assert set(probes) == {f"floods/{name}" for name in report["phases"]["floods"]["by_flood"]}
    for name, rows in probes.items():
        assert len(rows["probes"]) == report["phases"]["floods"]["by_flood"][name.split("/")[1]]["probe"]["n"], name
        assert len(rows["quiet_probes"]) > 0
        assert all(isinstance(p["passed_reason"], str) for p in rows["probes"])  # why a step passed it over, if one did
        assert "probes" not in report["phases"]["floods"]["by_flood"][name.split("/")[1]]


def test_the_ratio_interval_is_wide_for_few_probes_narrow_for_many_and_covers_a_known_ratio():
    import numpy as np

    rng = np.random.default_rng(1)
    quiet = lambda n: list(10 + rng.exponential(1.0, n))  # noqa: E731  a probe's latency: a floor and a tail
    loaded = lambda n: list(2 * (10 + rng.exponential(1.0, n)))  # noqa: E731  the same probe, twice as slow
    few, many = ratio_interval(loaded(40), quiet(40)), ratio_interval(loaded(2000), quiet(2000))
    assert few[0] <= 2.0 <= few[1] and many[0] <= 2.0 <= many[1], (few, many)
    assert many[1] - many[0] < (few[1] - few[0]) / 2, (few, many)
    a, b = loaded(40), quiet(40)
    assert ratio_interval(a, b) == ratio_interval(a, b)  # seeded: a report's interval can be recomputed
    assert ratio_interval([5.0], [5.0, 6.0]) is None  # one probe: no interval
