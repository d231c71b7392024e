"""The scaling streams workload's tp setup on CPU: the tiny Qwen2-VL split over two gloo ranks of a
LocalGroup, random weights drawn on each rank, warmed up on both, cameras through the RPyC front end,
then a chunk profiled on rank 0 with its communication share; rows and report name the model, the TP
size and the GPUs. A search past its budget keeps the points it measured; bad options are refused
before anything is built."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from bench.scaling_streams import ScalingStreamsJob, _search
from bench.scaling_streams_report import saved_whole
from vlora.commands.bench import run
from vlora.config import compose

BASE = ["bench.suite=scaling", "bench.scaling.workload=streams", "bench.scaling.streams.device=cpu",
        "bench.scaling.streams.model=qwen2_vl_tiny", "bench.scaling.streams.setups=[tp]"]


def test_a_split_model_serves_cameras_through_the_front_end(vlora_home, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = compose("bench", BASE + [
        "bench.scaling.streams.image_size=56", "bench.scaling.streams.stream_counts=[1,2]",
        "bench.scaling.streams.seconds=2", "bench.scaling.streams.warmup_s=0", "bench.scaling.streams.warmup_point_s=0",
        "bench.scaling.streams.refine=0", "bench.scaling.streams.target_ms=5000", "bench.scaling.streams.sustain_s=0",
        "bench.scaling.streams.drain_s=20",
        "bench.scaling.streams.chunk_pool=4", "bench.scaling.streams.adapters=2",
        "bench.scaling.streams.max_batch_size=4", "bench.scaling.streams.max_tokens_per_step=1024",
        "bench.scaling.streams.engine_warm_up=true",  # both ranks run the made-up waves together
        f"bench.out_dir={tmp_path}"])
    result = run(cfg)
    rows, summary = result["scaling"], result["meta"]
    assert [(r["setup"], r["model"], r["tp"], r["gpus"], r["streams"]) for r in rows] == \
        [("tp", "qwen2_vl_tiny", 2, 2, 1), ("tp", "qwen2_vl_tiny", 2, 2, 2)]  # stream_counts per group
    assert all(r["pass"] and r["settled"] and r["done"] == r["sent"] > 0 for r in rows)
    tp = summary["setups"]["tp-2"]
    assert (tp["model"], tp["tp"], tp["gpus"], tp["cameras"], tp["complete"]) == ("qwen2_vl_tiny", 2, 2, 2, True)
    chunk = tp["profile"]["chunk"]  # gloo's collectives inside one chunk's head answer, profiled on rank 0
    assert 0 < chunk["comm_us"] < chunk["span_us"] and 0 < tp["chunk_comm_share"] < 1
    assert tp["profile"]["decode"] == []  # no CUDA graphs on the CPU
    saved = json.loads((tmp_path / "cpu" / "streams_tp_2.json").read_text())["meta"]
    assert saved["complete"] and saved["memory_built"]["rank0_param_gib"] > 0 and saved["load_s"] > 0
    assert saved["warm_up"]["requests"] > 0  # on both ranks: rank 0 alone would wait in its first all-reduce
    text = (tmp_path / "cpu" / "streams_scaling.md").read_text()
    assert "| tp | qwen2_vl_tiny | 2 | 2 | 2" in text and "qwen2_vl_tiny over 2 GPUs (TP=2)" in text

    again = run(cfg)  # saved whole for this model: nothing is measured again
    assert again["scaling"] == rows and again["meta"] == summary


def test_a_search_past_its_budget_keeps_the_points_measured(tmp_path, monkeypatch):
    import bench.scaling_streams_point as point

    job = ScalingStreamsJob(device="cpu", model="qwen2_vl_tiny", setups=("tp",), warmup_point_s=0, budget_s=1.0,
                            stream_counts=(1, 2, 3, 4))
    plan = SimpleNamespace(adapters={"a0": "x"}, chunks=[], deadline=time.monotonic() + 3600)

    def run_point(engine, job, n, chunks, names):  # the budget runs out during the second point
        if n == 2:
            plan.deadline = time.monotonic() - 1
        return {"streams": n, "pass": True}

    monkeypatch.setattr(point, "run_scaling_point", run_point)
    saves = []
    rows = _search(None, job, plan, "tp", 2, save=lambda r: saves.append([x["streams"] for x in r]))
    assert [(r["setup"], r["tp"], r["gpus"], r["streams"]) for r in rows] == [("tp", 2, 2, 1), ("tp", 2, 2, 2)]
    assert saves == [[1], [1, 2]]  # saved after every point: a run killed later keeps them
    path = tmp_path / "streams_tp_2.json"
    for meta, whole in [({"model": "m", "complete": False}, False), ({"model": "other", "complete": True}, False),
                        ({"model": "m", "complete": True}, True), ({"job": {"model": "m"}}, True)]:
        path.write_text(json.dumps({"meta": meta, "rows": []}))
        assert saved_whole(path, "m") is whole, meta


def test_bad_tp_options_are_refused_before_anything_is_built(tmp_path):
    with pytest.raises(ValueError, match="tp_size"):
        ScalingStreamsJob(device="cpu", model="qwen2_vl_tiny", setups=("tp",), tp_size=1)
    with pytest.raises(ValueError, match="budget_s"):
        ScalingStreamsJob(device="cpu", model="qwen2_vl_tiny", setups=("tp",), budget_s=0)
    with pytest.raises(ValueError, match="tp_size=3 does not split qwen2_vl_tiny"):
        run(compose("bench", BASE + ["bench.scaling.streams.tp_size=3", f"bench.out_dir={tmp_path}"]))
    assert not (tmp_path / "cpu").exists()


def test_the_report_of_a_gpu_run_names_memory_and_each_steps_communication():
    from bench.scaling_streams_report import markdown, summarize

    # what a GPU run saves (the decode profiles come from bench.tp_rank.op_profile, GPU only)
    meta = {"setup": "tp", "gpus": 2, "model": "qwen2_vl_72b", "tp": 2, "load_s": 150.0, "complete": True,
            "memory_built": {"rank0_param_gib": 71.3, "rank0_peak_gib": 74.0},
            "profile": {"chunk": {"span_us": 150e3, "busy_us": 120e3, "comm_us": 30e3, "comm_share": 0.2,
                                  "comm_of_busy": 0.25},
                        "decode": [{"span_us": 20e3, "busy_us": 19e3, "nccl_us": 3e3, "comm_share": 0.15,
                                    "batch": b, "context": 803} for b in (1, 5)]}}
    rows = [{"point": "warm", "streams": n, "pass": n <= 5, "p95_ms": 100.0 * n} for n in (4, 5, 6)]
    summary = {"target_ms": 1000.0, **summarize([(meta, rows)])}
    tp = summary["setups"]["tp-2"]
    assert (tp["cameras"], tp["chunk_comm_share"], tp["decode_comm_share"]) == (5, 0.2, 0.15)
    text = markdown(summary, [])
    assert "| tp | qwen2_vl_72b | 2 | 2 | 5 |" in text and "rank 0 holds 71.3 GiB" in text and "peak 74.0 GiB" in text
    assert "| 2.5 | no one-GPU run |" in text and "nan" not in text  # no single-GPU 72B to scale against
    assert "5 cameras within target (p95 500 ms there)" in text and "20% of the span" in text
    assert "decode step at batch 5 (803 tokens of context)" in text and "= 15%" in text
