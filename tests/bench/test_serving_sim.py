"""The serving bench's load sweep in the simulator: a GPU run's folder (profile, policies, seeded
traces) replayed on the CPU at other seeds and loads, with means, 95% intervals and verdicts."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from bench.serving_sim import main

RUN = Path(__file__).resolve().parents[2] / "results/serving/nvidia_h200/learned_r64_all7"


def test_a_gpu_runs_load_sweep_simulated_over_seeds(tmp_path):
    out = tmp_path / "sim"
    main([str(RUN), "--out", str(out), "--seeds", "0", "1", "--duration", "2", "--loads", "0.5", "0.85",
          "--policies", "v_lora", "merge_only", "--host-ms", "3", "--image-ms", "10", "--delora-x", "4"])
    with open(out / "serving.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["x"], r["seed"], r["policy"]) for r in rows] == [
        (x, s, p) for x in ("0.5", "0.85") for s in ("0", "1") for p in ("v_lora", "merge_only")]
    capacity = json.loads((RUN / "capacity.json").read_text())["capacity_rps"]
    assert float(rows[0]["rate"]) == pytest.approx(0.5 * capacity)
    assert all(int(r["completed"]) == int(r["requests"]) > 0 for r in rows)
    with open(out / "summary.csv", newline="") as f:
        assert {(r["x"], r["policy"], r["seeds"]) for r in csv.DictReader(f)} == {
            (x, p, "2") for x in ("0.5", "0.85") for p in ("v_lora", "merge_only")}
    assert "v_lora / best fixed (merge_only)" in (out / "table.md").read_text()
    assert "not a GPU measurement" in json.loads((out / "config.json").read_text())["note"]


def test_a_folder_that_is_no_run_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no profile.json, serving.json, traces.json"):
        main([str(tmp_path), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        main([str(RUN), "--out", str(tmp_path / "o"), "--loads", "0.5"])  # regenerating needs --seeds
