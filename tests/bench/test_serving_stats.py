"""The serving evaluation's statistics: intervals, capacity from a burst, verdicts against fixed policies."""

from __future__ import annotations

import math

import pytest

from bench.serving_stats import capacity_rps, mean_interval, summarize_points, verdicts


def test_mean_interval_is_the_student_t_interval():
    mean, half = mean_interval([10.0, 12.0, 14.0])
    assert mean == 12.0 and half == pytest.approx(4.303 * 2.0 / math.sqrt(3))  # sd 2, n 3, t(0.975, 2)
    assert math.isnan(mean_interval([5.0])[1]) and mean_interval([5.0])[0] == 5.0
    assert mean_interval([7.0, 7.0])[1] == 0.0


def test_capacity_reads_the_middle_of_a_burst():
    # 100 finishes: a slow start, then one every 50 ms, then a slow tail: 20 requests/s in the middle
    finish = [1000.0 + 500 * i for i in range(5)] + [3500.0 + 50 * i for i in range(90)] + \
        [9000.0 + 800 * i for i in range(5)]
    assert capacity_rps(finish) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="at least 10"):
        capacity_rps([1.0, 2.0])


def test_verdicts_compare_with_the_best_fixed_policy_at_each_point():
    rows = []
    for policy, values in {"v_lora": [9.0, 10.0, 11.0], "unmerge_only": [11.0, 12.0, 13.0],
                           "merge_only": [20.0, 21.0, 22.0], "dlora": [10.0, 10.5, 11.0]}.items():
        rows += [dict(sweep="load", x=0.85, skewness=0.9, policy=policy, seed=i, rate=5.0, completed=3,
                      requests=3, avg_token_latency_ms=v) for i, v in enumerate(values)]
    summary = summarize_points(rows)
    (v,) = verdicts(summary)
    assert v["best_fixed"] == "dlora" and v["ratio_best"] == pytest.approx(10.0 / 10.5)
    assert v["ratio_unmerge"] == pytest.approx(10.0 / 12.0) and v["overlap"]
