"""bench.policy_cost: the host cost per step of each policy, written per policy and load."""

from __future__ import annotations

import csv
import json

import pytest

from bench.policy_cost import main


def test_writes_the_host_cost_per_policy_and_load(tmp_path, capsys):
    main(["--loads", "0.5", "--seeds", "0", "--duration", "1", "--out", str(tmp_path),
          "--policies", "v_lora", "merge_only"])
    rows = list(csv.DictReader((tmp_path / "policy_cost.csv").open()))
    assert [r["policy"] for r in rows] == ["v_lora", "merge_only"]
    assert all(int(r["steps"]) > 0 and float(r["host_us_median"]) > 0 for r in rows)
    meta = json.loads((tmp_path / "policy_cost.json").read_text())
    assert meta["command"].startswith("python -m bench.policy_cost") and len(meta["rows"]) == 2
    assert "load=0.5 v_lora" in capsys.readouterr().out


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path)])  # not a serving run's folder
    with pytest.raises(SystemExit):
        main(["--duration", "0"])


def test_several_runs_give_each_cases_median_and_spread_over_runs(tmp_path):
    main(["--loads", "0.5", "--seeds", "0", "--duration", "0.5", "--out", str(tmp_path), "--policies", "merge_only",
          "--repeat", "1", "--runs", "3"])
    rows = list(csv.DictReader((tmp_path / "policy_cost.csv").open()))
    assert [r["run"] for r in rows] == ["0", "1", "2"]
    (summary,) = list(csv.DictReader((tmp_path / "policy_cost_summary.csv").open()))
    assert summary["runs"] == "3" and summary["policy"] == "merge_only"
    medians = sorted(float(r["host_us_median"]) for r in rows)
    assert float(summary["host_us_median"]) == round(medians[1], 1)
    assert (float(summary["host_us_median_min"]), float(summary["host_us_median_max"])) == (medians[0], medians[-1])
    meta = json.loads((tmp_path / "policy_cost.json").read_text())
    assert meta["cpus"] >= 1 and meta["load_average_1min"] >= 0 and len(meta["summary"]) == 1
    with pytest.raises(SystemExit):
        main(["--runs", "0"])
