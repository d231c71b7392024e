"""The serving evaluation on the real engine (CPU, tiny Qwen2-VL, two PEFT adapters): two policies
replay the same generated workload in real time; every request is accounted for, the metrics are
plausible, and the CSV, JSON, traces (as seeded specs) and plot are written."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from adapter_cases import build_adapters
from adapter_cases import one_thread  # noqa: F401 (autouse: one intra-op thread here)

from bench.serving import ServingBenchJob, run_serving_bench
from bench.serving_traces import rebuild
from serve.orchestrator import read_trace


def test_serving_bench_two_policies(vlora_home, tmp_path):
    from zoo import build_checkpoint

    ckpt = build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")
    adapters = build_adapters(ckpt, tmp_path / "adapters", ("qv8", "all16"))
    from bench.adapters import write_head
    from serve.models import read_model_args

    for path in adapters.values():  # the head-mode video requests (half of the video ones) need a head
        write_head(Path(path), read_model_args(ckpt)[0].hidden_size)
    job = ServingBenchJob(
        checkpoint=str(ckpt), device="cpu", dtype="float32", rank=16,
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        adapter_dirs=tuple(f"{n}={p}" for n, p in adapters.items()), rates=(6.0,),
        # D = the requests present: a lone request of one adapter dominates, so V-LoRA's policy switches
        policies=({"name": "v_lora_paper", "share_of": "present", "max_switch_share": 1.0}, "unmerge_only"),
        skewness=(0.8,), duration_s=2.0, drain_s=20.0, warmup_s=1.0, image_size=56, video_frames=(1, 2),
        video_output_tokens=(2, 3), retrieval_output_tokens=(4, 8), text_tokens=(4, 12), max_batch_size=8,
        max_tokens_per_step=1024, profile="assumed", mode_other_shares=(0.5,), mode_decode_seqs=4,
        mode_prefill=(2, 32), out_dir=str(tmp_path / "out"))
    rows, meta = run_serving_bench(job)

    assert [r["policy"] for r in rows] == ["v_lora_paper", "unmerge_only"]
    out = tmp_path / "out" / "cpu"
    name = "trace_skewness_0.8_skew0.8_seed0.jsonl"  # kept as its seeded spec, rebuilt byte for byte
    assert not (out / name).exists() and (out / "traces.json").is_file()
    trace = read_trace(rebuild(out / "traces.json", name, tmp_path / "rebuilt"))
    assert len(trace) >= 2 and {r.adapter for r in trace} <= {"adapter-000", "adapter-001"}
    assert {(r.app, r.output_mode) for r in trace} >= {("video_analytics", "head"), ("video_analytics", "generate")}
    for r in rows:
        assert r["requests"] == len(trace) and r["completed"] + r["aborted"] == r["requests"]
        assert r["completed"] == r["requests"]  # 6 requests/s is far below the tiny model's capacity on CPU
        assert r["p50_ms"] > 0 and r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"]
        assert 0 < r["avg_token_latency_ms"] < r["p99_ms"]  # every request generates >= 2 tokens
        assert r["throughput_rps"] > 0 and 0 <= r["slo_attainment"] <= 1
        assert r["switches"] >= 0 and r["switch_ms"] >= 0 and not math.isnan(r["avg_wait_ms"])
        assert r["replay_s"] >= 1.0  # arrivals spread over the 2 s of the trace
    unmerge = rows[1]
    assert unmerge["switches"] == 0 and unmerge["steps_merge"] == unmerge["steps_mixture"] == 0
    v_lora = rows[0]
    assert v_lora["switches"] > 0 and v_lora["switch_ms"] > 0 and v_lora["steps_merge"] > 0
    with open(out / "serving.csv", newline="") as f:
        assert [(r["policy"], r["completed"]) for r in csv.DictReader(f)] == \
            [(r["policy"], str(r["completed"])) for r in rows]
    assert json.loads((out / "serving.json").read_text())["meta"]["adapters"] == ["qv8", "all16"]
    assert (out / "latency_vs_skewness.png").stat().st_size > 1000 and (out / "profile.json").is_file()
    modes = meta["modes"]
    assert [(m["step"], m["seqs"], m["tokens"], m["other_seqs"]) for m in modes] == \
        [("decode", 4, 4, 2), ("prefill", 2, 32, 1)]
    assert all(m["plain_ms"] > 0 and m["unmerge_ms"] > 0 and m["mixture_ms"] > 0 for m in modes)
    assert (out / "modes.csv").is_file()


def test_load_sweep_measures_capacity_repeats_seeds_and_resumes(vlora_home, tmp_path):
    """The load sweep: unmerge-only's capacity from a burst, each point at a share of it, several
    seeds per point summarized with a 95% interval, V-LoRA held against the fixed policies; a rerun
    of the folder replays nothing it already has."""
    from zoo import build_checkpoint

    ckpt = build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")
    adapters = build_adapters(ckpt, tmp_path / "adapters", ("qv8", "all16"))
    job = ServingBenchJob(
        checkpoint=str(ckpt), device="cpu", dtype="float32", rank=16,
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        adapter_dirs=tuple(f"{n}={p}" for n, p in adapters.items()), video_head_share=0.0,
        policies=("v_lora", "unmerge_only"), sweeps=("load",), loads=(0.5,), skewness=(0.8,), seeds=(0, 1),
        capacity_requests=12, capacity_probe_s=1.0, duration_s=1.0, drain_s=20.0, warmup_s=0.0, image_size=56, video_frames=(1, 1),
        video_output_tokens=(2, 2), retrieval_output_tokens=(2, 4), text_tokens=(4, 8), max_batch_size=4,
        max_tokens_per_step=512, profile="assumed", mode_other_shares=(), out_dir=str(tmp_path / "out"),
        tag="r16_all")
    rows, meta = run_serving_bench(job)
    out = tmp_path / "out" / "cpu" / "r16_all"
    cap = json.loads((out / "capacity.json").read_text())
    assert cap["capacity_rps"] > 0 and cap["requests"] >= 10 and cap["completed"] == cap["requests"]
    # the burst's estimate, then Poisson arrivals at 1.3x it: the capacity is what they were served at
    assert cap["arrival"] == "poisson" and cap["probe_rate"] == pytest.approx(1.3 * cap["burst_rps"])
    assert cap["capacity_rps"] == cap["poisson_rps"] or cap["lower_bound"]
    if cap["lower_bound"]:  # kept up: capacity is at least what was offered, never what a short window "served"
        assert cap["capacity_rps"] == pytest.approx(max(min(cap["poisson_rps"], cap["probe_rate"]), cap["burst_rps"]))
    assert [(r["policy"], r["seed"]) for r in rows] == [("v_lora", 0), ("unmerge_only", 0), ("v_lora", 1),
                                                       ("unmerge_only", 1)]  # reported in the order given
    # each seed replayed the two in its own order (seeded: a rerun keeps it)
    assert [r["run_order"] for r in rows] == [1, 0, 0, 1]
    learnt = rows[0]  # the learning policy reports how well it predicted the steps it served
    assert learnt["learned_steps"] > 0 and 0 <= learnt["pred_err_median"] < 10
    assert math.isnan(rows[1]["pred_err_median"]) and rows[1]["learned_steps"] == 0
    # what a replay far off its peers is read by: its slowest step against its prediction, the guard's
    # fallbacks by kind, kernels compiled during it, and its switches and fallbacks in decisions/
    assert learnt["slowest_step_ms"] > 0 and learnt["slowest_step_mode"] and learnt["kernel_compiles"] == 0
    assert learnt["guard_to_merge"] + learnt["guard_to_unmerge"] == learnt["guard_engaged"]
    log = json.loads((out / "decisions" / "load_0.5_skew0.8_seed0_v_lora.json").read_text())
    assert log["policy"] == "v_lora" and log["stats"]["learning"]["slowest"]
    assert all(d["switch"] or d["reason"].startswith("guard") or d["measured_ms"] > d["predicted_ms"]
               for d in log["decisions"])
    assert not (out / "decisions" / "load_0.5_skew0.8_seed0_unmerge_only.json").exists()  # nothing learnt
    assert all(r["rate"] == pytest.approx(0.5 * cap["capacity_rps"]) and r["x"] == 0.5 for r in rows)
    assert rows[0]["requests"] != rows[2]["requests"] or rows[0]["avg_latency_ms"] != rows[2]["avg_latency_ms"]
    with open(out / "summary.csv", newline="") as f:
        summary = {r["policy"]: r for r in csv.DictReader(f)}
    assert set(summary) == {"v_lora", "unmerge_only"}
    for policy, s in summary.items():
        values = [r["avg_token_latency_ms"] for r in rows if r["policy"] == policy]
        assert int(s["seeds"]) == 2 and float(s["mean"]) == pytest.approx(sum(values) / 2)
        assert math.isfinite(float(s["ci95"])) and float(s["ci95"]) >= 0
    with open(out / "verdicts.csv", newline="") as f:
        (verdict,) = list(csv.DictReader(f))
    assert verdict["best_fixed"] == "unmerge_only" and float(verdict["ratio_best"]) == pytest.approx(
        float(summary["v_lora"]["mean"]) / float(summary["unmerge_only"]["mean"]))
    assert (out / "latency_vs_load_ci.png").stat().st_size > 1000
    again, _ = run_serving_bench(job)  # resumes: every row is read back, none replayed
    assert [(r["policy"], r["seed"], r["replay_s"]) for r in again] == \
        [(r["policy"], r["seed"], pytest.approx(r["replay_s"])) for r in rows]


def test_replay_preprocesses_off_the_stepping_thread(vlora_home):
    """With prepare threads every request is preprocessed on one of them (as the RPC server does on
    its connections) and handed to add_request prepared; without, add_request preprocesses on the
    stepping thread. Both replays complete every request."""
    import threading

    from zoo import build_checkpoint

    from serve import Engine, EngineConfig
    from bench.serving_replay import build_requests, replay
    from serve.orchestrator import generate

    ckpt = build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")
    engine = Engine(ckpt, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128, enable_prefix_cache=False))
    job = ServingBenchJob(device="cpu", rates=(8.0,), skewness=(1.0,), adapters=1, duration_s=1.0, image_size=56,
                          video_head_share=0.0,  # served by the base model here: no head
                          video_frames=(1, 2), video_output_tokens=(2, 3), retrieval_output_tokens=(2, 4),
                          text_tokens=(4, 12))
    trace = generate(job.workload())
    where, added = [], {}
    prepare, add = engine.prepare, engine.add_request

    def traced_prepare(request):
        where.append(threading.current_thread().name)
        return prepare(request)

    def traced_add(request, prepared=None):
        added.setdefault(prepared is None, set()).add(request.request_id)
        return add(request, prepared)

    engine.prepare, engine.add_request = traced_prepare, traced_add
    rows = {}
    for threads in (0, 2):
        where.clear()
        requests = build_requests(trace, [], 56, seed=1, text_tokens=8, max_frames=2)
        # each application's target and priority reach the request (what the policy reads)
        assert [(r.app, r.slo_ms, r.priority) for r in requests] == [(v.app, v.slo_ms, v.priority) for v in trace]
        for r in requests:
            r.adapter = None  # the base model
        row, extra = replay(engine, trace, requests, drain_s=30.0, prepare_threads=threads)
        assert row["completed"] == len(trace) >= 2 and extra["aborted"] == 0
        rows[threads] = list(where)
    assert all(name == threading.current_thread().name for name in rows[0])  # add_request's own prepare
    assert len(rows[2]) == len(trace) and all(name.startswith("prepare") for name in rows[2])
    assert added[True] == added[False] == {r.request_id for r in trace}


def test_a_probe_that_kept_up_bounds_capacity_by_its_offered_rate(monkeypatch, tmp_path):
    """Finishes over a few seconds can outpace the arrivals: the bound is the offered rate."""
    import bench.serving_capacity as capacity

    served = iter([10.0, 20.5])  # the burst's estimate, then a probe offered 13/s that "served" 20.5/s
    monkeypatch.setattr(capacity, "_served_rps", lambda *a: (next(served), {"requests": 50, "completed": 50},
                                                             {"replay_s": 4.0}))
    job = type("Job", (), {"workload": lambda self: capacity.WorkloadSpec(), "capacity_requests": 64, "seed": 0,
                           "capacity_arrival": "poisson", "capacity_overload": 1.3, "capacity_probe_s": 4.0})()
    cap = capacity.measure_capacity(None, job, [], tmp_path)
    assert cap["lower_bound"] and cap["capacity_rps"] == pytest.approx(13.0)
