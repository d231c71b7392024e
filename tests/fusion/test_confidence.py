"""The interval of a mean over runs (fusion against another method, one difference per seed)."""

from __future__ import annotations

import pytest


def test_the_interval_of_a_mean_uses_students_t():
    from fusion.confidence import mean_interval

    # scipy.stats.t.interval(0.95, df, loc=mean, scale=sem), computed once: df 2 and df 4
    mean, lo, hi = mean_interval([-0.014, 0.016, -0.013])
    assert (round(mean, 4), round(lo, 4), round(hi, 4)) == (-0.0037, -0.046, 0.0387)
    assert tuple(round(v, 4) for v in mean_interval([1.0, 2.0, 3.0, 4.0, 5.0])) == (3.0, 1.0368, 4.9632)
    many = [0.0, 1.0] * 50  # 100 values: past the table, the normal quantile
    assert round(mean_interval(many)[2] - 0.5, 4) == round(1.96 * (sum((v - 0.5) ** 2 for v in many) / 99) ** 0.5 / 10, 4)
    with pytest.raises(ValueError, match="at least two"):
        mean_interval([0.5])
