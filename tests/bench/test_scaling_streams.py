"""The scaling suite's streams workload on CPU (`vlora bench bench.suite=scaling bench.scaling.workload=streams`):
the tiny Qwen2-VL with 56-pixel chunks, one engine and two Ray Serve replicas behind the RPyC front
end, a camera per GPU; the efficiency against one engine, the replicas' adapter loads, and a replica
killed under load with no chunk lost; the report it writes; bad options refused before Ray starts."""

from __future__ import annotations

import csv
import json
import math

import pytest

from bench.scaling_streams import ScalingStreamsJob, streams_job
from bench.scaling_streams_point import kill_report
from vlora.commands.bench import run
from vlora.config import compose

BASE = ["bench.suite=scaling", "bench.scaling.workload=streams", "bench.scaling.streams.device=cpu",
        "bench.scaling.streams.model=qwen2_vl_tiny"]


def test_bad_options_are_refused_before_ray_starts():
    ray = pytest.importorskip("ray")
    for values, match in [({"setups": ["single", "pipeline"]}, "setups"), ({"gpus": [4, 2]}, "gpus"),
                          ({"kill_after_s": 10.0, "kill_seconds": 5.0}, "kill_after_s"),
                          ({"modes": ["generate"]}, "heads only"), ({"kill_share": 1.5}, "kill_share"),
                          ({"setups": ["single"], "kill_cameras": 2}, "needs the replicas setup"),
                          ({"stream_counts": [0]}, "stream_counts"), ({"frames": 3}, "no option")]:
        with pytest.raises(ValueError, match=match):
            streams_job("streams", {"device": "cpu", "model": "qwen2_vl_tiny", **values}, "out")
    with pytest.raises(ValueError, match="give serving or streams"):
        streams_job("camera", {}, "out")
    cfg = compose("bench", BASE + ["bench.scaling.streams.gpus=[2,1]"])
    with pytest.raises(ValueError, match="gpus"):
        run(cfg)
    assert not ray.is_initialized()


def test_recovery_is_the_first_second_from_which_every_later_one_meets_the_target():
    # chunks sent at the kill's second -2 .. 5; seconds 0 and 2 miss 1 s, 3 on meet it
    latency = {-2: 300, -1: 2500, 0: 3000, 1: 800, 2: 1500, 3: 400, 4: 350, 5: 300}
    records = [{"sent": 100.0 + s + 0.5, "latency_ms": ms, "finished": True} for s, ms in latency.items()]
    got = kill_report(records, {}, {"t": 100.0, "replica": "r1", "held": 1}, 1000.0)
    assert got["lost"] == 0 and got["recovered"] and got["recovery_s"] == 3.0
    assert got["spike_p95_ms"] == 3000 and got["p95_before_ms"] == 300
    assert [t["second"] for t in got["timeline"]] == sorted(latency)
    records[-1]["finished"] = False  # unanswered: lost, and the last second never met the target again
    records[-1]["latency_ms"] = 5000
    got = kill_report(records, {"replica": 1}, {"t": 100.0, "replica": "r1", "held": 1}, 1000.0)
    assert got["lost"] == 2 and not got["recovered"] and math.isnan(got["recovery_s"])


def test_one_engine_and_replicas_and_a_killed_replica(vlora_home, tmp_path, monkeypatch):
    pytest.importorskip("ray.serve")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = compose("bench", BASE + [
        "bench.scaling.streams.image_size=56", "bench.scaling.streams.stream_counts=[1]",
        "bench.scaling.streams.gpus=[2]", "bench.scaling.streams.seconds=2",
        "bench.scaling.streams.warmup_s=0", "bench.scaling.streams.warmup_point_s=0", "bench.scaling.streams.refine=0",
        "bench.scaling.streams.target_ms=5000",  # a busy two-core machine must still pass one camera per engine
        "bench.scaling.streams.sustain_s=0",  # ... whatever its latency trend over a short window
        "bench.scaling.streams.drain_s=20", "bench.scaling.streams.chunk_pool=4", "bench.scaling.streams.adapters=2",
        "bench.scaling.streams.max_batch_size=8", "bench.scaling.streams.max_tokens_per_step=1024",
        # engines warm up as on a GPU: a replica (the killed one's replacement too) takes chunks only once warm
        "bench.scaling.streams.engine_warm_up=true", "bench.scaling.streams.kill_cameras=2",
        "bench.scaling.streams.kill_after_s=2", "bench.scaling.streams.kill_seconds=5",
        f"bench.out_dir={tmp_path}"])
    result = run(cfg)
    rows, summary = result["scaling"], result["meta"]
    assert [(r["setup"], r["gpus"], r["point"], r["streams"]) for r in rows] == \
        [("single", 1, "warm", 1), ("replicas", 2, "warm", 2), ("replicas", 2, "kill", 2)]
    assert all(r["pass"] for r in rows[:2]) and all(r["settled"] for r in rows)
    single, replicas = summary["setups"]["single-1"], summary["setups"]["replicas-2"]
    assert single["cameras"] == 1 and replicas["cameras"] == 2 and replicas["cameras_per_gpu"] == 1.0
    assert replicas["efficiency"] == pytest.approx(2 / (2 * 1)) and not replicas["bounded"]
    # adapters load on demand, once per replica that got them: every adapter was loaded, none twice on one replica
    loads = replicas["adapter_loads"]
    assert set(replicas["replicas_per_adapter"]) == {"a0", "a1"}
    assert all(n == 1 for per in loads.values() for n in per.values())
    assert sum(rows[1]["chunks_by_replica"].values()) == rows[1]["done"]

    kill = summary["kill"]
    assert kill["killed"] and not kill.get("kill_error") and kill["lost"] == 0
    assert kill["recovered"] and kill["recovery_s"] >= 0 and kill["spike_p95_ms"] > 0
    # the victim was killed while it held a chunk (whether it finished it before dying is a race: retried >= 0)
    assert rows[2]["done"] == rows[2]["sent"] > 0 and kill["victim_held"] > 0 and kill["retried"] >= 0
    out = tmp_path / "cpu"
    with open(out / "streams_kill.csv") as f:
        timeline = list(csv.DictReader(f))
    assert timeline and {int(t["second"]) for t in timeline} >= {0, 1}  # seconds around the kill
    with open(out / "streams_scaling_setups.csv") as f:
        per_setup = {r["setup"]: r for r in csv.DictReader(f)}
    assert float(per_setup["replicas"]["efficiency"]) == 1.0 and float(per_setup["replicas"]["cameras_per_gpu"]) == 1.0
    assert "chunks lost: 0" in (out / "streams_scaling.md").read_text()
    assert json.loads((out / "streams_scaling.json").read_text())["setups"]["replicas-2"]["cameras"] == 2
    assert (out / "streams_kill_2.json").is_file()  # saved apart: a rerun of the kill alone resumes after the search

    # run again: both setups are saved, so nothing is measured and the report is the same
    again = run(cfg)
    assert again["scaling"] == rows and again["meta"] == summary
