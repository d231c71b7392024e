"""The scaling evaluation on CPU (tiny Qwen2-VL, random weights, two random adapters): one engine,
two gloo tensor-parallel ranks and, where Ray is installed, two Ray Serve replicas replay the
serving workload at a rate they hold and one far past the knee; capacity, efficiency and resuming."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from bench.scaling import ScalingBenchJob, capacity, run_scaling_bench


def _row(rate, share, attainment=0.9):
    return {"rate": rate, "met_share": share, "meets_target": share >= attainment}


def test_capacity_interpolates_between_the_last_met_and_the_first_missed_rate():
    rows = [_row(8, 1.0), _row(10, 0.95), _row(12, 0.7), _row(14, 0.95)]  # 14 is past the knee: not counted
    got = capacity(rows, 0.9)
    assert got["measured_rps"] == 10 and got["bounded"]
    assert got["capacity_rps"] == pytest.approx(10 + 2 * (0.95 - 0.9) / (0.95 - 0.7))
    assert capacity([_row(8, 1.0), _row(10, 0.99)], 0.9) == {"measured_rps": 10, "capacity_rps": 10,
                                                             "bounded": False}  # no knee: a lower bound
    assert capacity([_row(8, 0.5)], 0.9)["capacity_rps"] == 0.0


def test_bad_jobs_are_refused():
    with pytest.raises(ValueError, match="setups"):
        ScalingBenchJob(setups=("single", "pipeline"))
    with pytest.raises(ValueError, match="rise"):
        ScalingBenchJob(rates=(10.0, 8.0))
    with pytest.raises(ValueError, match="one policy"):
        ScalingBenchJob(policies=("v_lora", "unmerge_only"))
    with pytest.raises(ValueError, match="skewness 0.6"):
        ScalingBenchJob(adapters=1)


def test_setups_sweep_to_the_knee_and_resume(vlora_home, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    setups = ("single", "tensor_parallel") + (("replicas",) if importlib.util.find_spec("ray") else ())
    job = ScalingBenchJob(model="qwen2_vl_tiny", device="cpu", dtype="float32", adapters=2, rank=8, setups=setups,
                          rates=(2.0, 400.0), duration_s=2.0, drain_s=3.0, warmup_s=1.0, image_size=56,
                          video_frames=(1, 2), video_output_tokens=(2, 3), retrieval_output_tokens=(4, 8),
                          text_tokens=(4, 12), max_batch_size=8, max_tokens_per_step=1024, profile="measure",
                          out_dir=str(tmp_path))
    rows, summary = run_scaling_bench(job)
    out = tmp_path / "cpu"
    assert {r["setup"] for r in rows} == set(setups)
    for setup in setups:
        rs = [r for r in rows if r["setup"] == setup]
        gpus = 1 if setup == "single" else 2
        assert [r["rate"] for r in rs] == [2.0 * gpus, 400.0 * gpus] and all(r["gpus"] == gpus for r in rs)
        low, high = rs
        assert low["meets_target"] and low["completed"] == low["requests"] > 0
        assert all(r["steps_unmerge"] + r["steps_merge"] + r["steps_mixture"] > 0 for r in rs)  # engines' counters
        # four hundred requests/s per process is far past what the tiny model serves on two cores (and a
        # thousand spent most of the test making requests that could only be aborted)
        assert not high["meets_target"] and high["aborted"] > 0 and high["met_share"] < 0.9
        s = summary["setups"][setup]
        assert s["bounded"] and s["measured_rps"] == 2.0 * gpus and 2.0 * gpus <= s["capacity_rps"] < 400.0 * gpus
        assert s["load_s"] > 0 and s["gpus"] == gpus
    base = summary["setups"]["single"]["capacity_rps"]
    tp = summary["setups"]["tensor_parallel"]
    assert math.isclose(tp["efficiency"], tp["capacity_rps"] / (2 * base))
    if "replicas" in setups:  # both replicas answered
        meta = json.loads((out / "scaling_replicas.json").read_text())["meta"]
        assert len(meta["by_replica"]) == 2 and min(meta["by_replica"].values()) > 0
    assert (out / "scaling.png").stat().st_size > 1000 and (out / "scaling.csv").is_file()

    # run again: every setup was measured to its knee, so nothing is replayed and the report is the same
    saved = {s: (out / f"scaling_{s}.json").read_text() for s in setups}
    rows_again, summary_again = run_scaling_bench(job)
    assert {s: (out / f"scaling_{s}.json").read_text() for s in setups} == saved
    assert rows_again == rows and summary_again == summary


def test_the_command_runs_the_single_setup(vlora_home, tmp_path):
    import os
    import subprocess
    import sys

    overrides = ["bench.suite=scaling", "bench.scaling.device=cpu", "bench.scaling.model=qwen2_vl_tiny",
                 "bench.scaling.dtype=float32", "bench.scaling.adapters=2", "bench.scaling.rank=8",
                 "bench.scaling.setups=[single]", "bench.scaling.rates=[2,1000]", "bench.scaling.duration_s=2",
                 "bench.scaling.drain_s=2", "bench.scaling.warmup_s=0", "bench.scaling.image_size=56",
                 "bench.scaling.video_frames=[1,2]", "bench.scaling.max_batch_size=8", "bench.scaling.profile=assumed",
                 f"bench.out_dir={tmp_path}", f"hydra.run.dir={tmp_path}/run"]
    env = {**os.environ, "VLORA_HOME": str(vlora_home), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "vlora", "bench", *overrides], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "cpu" / "scaling.json").read_text())
    assert set(summary["setups"]) == {"single"} and summary["setups"]["single"]["bounded"]
    assert "single" in done.stdout and "capacity" in done.stdout
