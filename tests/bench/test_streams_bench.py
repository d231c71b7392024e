"""The streams evaluation (`vlora bench bench.suite=streams`) on CPU: the real config shrunk to the
tiny Qwen2-VL, 56-pixel frames and two stream counts, both modes and the transformers baseline,
through the real RPyC server; the report, CSV, JSON and plot it writes; the search's order."""

from __future__ import annotations

import csv
import json
import math
import re
from collections import Counter

import numpy as np
import pytest
import torch

from bench.streams import StreamsBenchJob, search
from vlora.commands.bench import run
from vlora.config import compose


@pytest.fixture
def one_thread():
    """Tiny-model ops gain nothing from a second thread; on a shared 2-core machine two OpenMP
    threads wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"{name} in JSON")
    return json.loads(text, parse_constant=refuse)


def test_streams_suite_on_cpu(vlora_home, tmp_path, one_thread, capsys):
    counts, seconds = [1, 3], 2
    cfg = compose("bench", ["bench.suite=streams", "bench.streams.device=cpu", "bench.streams.model=qwen2_vl_tiny",
                            "bench.streams.image_size=56", f"bench.streams.stream_counts={counts}",
                            f"bench.streams.seconds={seconds}", "bench.streams.warmup_s=0",
                            "bench.streams.warmup_point_s=0", "bench.streams.refine=0",
                            "bench.streams.target_ms=5000",  # a busy CI machine must still run every count
                            "bench.streams.sustain_s=0",  # ... whatever its latency trend over 2 s
                            "bench.streams.drain_s=20", "bench.streams.chunk_pool=4", "bench.streams.adapters=2",
                            "bench.streams.max_batch_size=8", "bench.streams.max_tokens_per_step=1024",
                            "bench.streams.hf_batch=2", "bench.streams.hf_batches=2", "bench.streams.engine_only_rates=[2.0]",
                            "bench.streams.cold_streams=2", f"bench.streams.cold_seconds={seconds}",
                            "bench.streams.encode_ahead=on", "bench.streams.ahead_off_counts=[1]",
                            "bench.streams.ramp_counts=[2]", "bench.streams.profile_first_steps=2",
                            f"bench.out_dir={tmp_path}"])
    result = run(cfg)
    rows, meta = result["streams"], result["meta"]

    # the cold point first (right after the engine's warm-up), the searches, then the warm point it is compared with
    assert [(r["point"], r["mode"], r["streams"]) for r in rows] == \
        [("cold", "head", 2)] + [("warm", m, n) for m in ("head", "generate") for n in counts] + \
        [("warm", "head", 2), ("warm-ahead-off", "head", 1), ("ramp", "head", 2)]
    assert all(r["settled"] and r["leftover_before"] == 0 and r["steps"] > 0 for r in rows)
    assert all(len(r["slow_steps"]) == min(5, r["steps"]) and r["step_max_ms"] == pytest.approx(r["slow_steps"][0][2], abs=0.06) for r in rows)
    cold = meta["cold"]
    assert cold["streams"] == 2 and cold["cold_p95_ms"] == rows[0]["p95_ms"] and cold["warm_p95_ms"] == rows[-3]["p95_ms"]
    assert cold["cold_vs_warm"] == pytest.approx(rows[0]["p95_ms"] / rows[-3]["p95_ms"])
    # the same start on the warmed server, measured from its first chunk as the cold point is
    ramp = rows[-1]
    assert cold["ramp_p95_ms"] == [ramp["p95_ms"]] and ramp["sent"] == ramp["done"] == 2 * seconds
    assert len(ramp["first_steps"]) == min(30, ramp["steps"])
    # the cold point's and the ramp's first two steps under the profiler: each step's wall time and top operators
    for r in (rows[0], ramp):
        profiles = r["step_profiles"]
        assert len(profiles) == 2 and all(p["wall_ms"] > 0 and p["ops"] for p in profiles)
        assert any(name.startswith("aten::") for p in profiles for name, calls, own, total in p["ops"])
        assert all(calls >= 1 and 0 <= own <= total for p in profiles for _, calls, own, total in p["ops"])
    assert all("step_profiles" not in r for r in rows[1:-1])
    printed = capsys.readouterr().out
    assert "cold 2, profiled step 1:" in printed and "ramp 2, profiled step 2:" in printed
    assert all(r["gc_full_ms"] == r["gc"]["full_ms"] for r in rows)  # a front end's full collections, in the table
    assert rows[-2]["done"] == rows[-2]["sent"] > 0 and rows[-2]["items_encoded_ahead"] == 0
    assert all(r["items_encoded"] >= 3 * r["done"] for r in rows)  # moving cameras: no frame group repeats
    assert meta["warm_up"]["requests"] == 2 * (1 + 2 + 4 + 8) and meta["start_s"] >= meta["engine_load_s"]
    # as under `vlora serve`: the engine built and warmed up in a process of its own before the server took
    # work; one server for every point; the warm-up's steps are not the cold point's
    assert meta["warm_up"]["thread"] == "engine process" and all(r["engine_process"] for r in rows)
    assert meta["start_s"] >= meta["engine_load_s"] + meta["warm_up"]["seconds"]
    assert rows[0]["steps"] < meta["warm_up"]["steps"] and rows[0]["items_encoded"] == 3 * rows[0]["sent"]
    # the cold point's first steps in order: where a backlog starts
    first = rows[0]["first_steps"]
    assert 0 < len(first) == min(30, rows[0]["steps"]) and all(seqs >= 1 and ms > 0 for seqs, _, ms in first)
    assert "first_steps" not in rows[1] and "first_phases_ms" not in rows[1]
    # and where their host time went, phase by phase: the phases of a step add up to no more than the step
    phases = rows[0]["first_phases_ms"]
    assert len(phases) == len(first) and all(len(p) == 6 and sum(p) <= ms + 0.5 for p, (_, _, ms) in zip(phases, first))
    assert all(set(r["phase_ms"]) == {"inputs", "vision", "forward", "sample", "ahead", "wait"} for r in rows)
    assert all(r["phase_ms"]["forward"] > 0 for r in rows)
    # the host time before each step: the loop's since the previous step (0 after an idle engine), then planning
    between = rows[0]["first_between_ms"]
    assert len(between) == len(first) and between[0][0] == 0 and all(loop >= 0 and plan > 0 for loop, plan in between)
    assert all(set(r["between_ms"]) == {"loop", "plan"} for r in rows)
    assert all(len(r["window_utc"]) == 2 and all(re.fullmatch(r"\d\d:\d\d:\d\d\.\d", t) for t in r["window_utc"])
               for r in rows)  # HH:MM:SS.s, UTC
    assert all(r["gc"]["collections"] >= r["gc"]["full"] >= 0 and r["gc"]["max_ms"] >= 0 for r in rows)
    visual = meta["visual_tokens_per_chunk"]
    assert visual == 3 * 2 * 2 and all(r["vision_tokens_per_s"] == pytest.approx(r["chunks_per_s"] * visual) for r in rows)
    rows = [r for r in rows if r["point"] == "warm"][:-1]
    assert [(r["mode"], r["streams"]) for r in rows] == [(m, n) for m in ("head", "generate") for n in counts]
    flops = meta["flops"]
    assert flops["patches"] == 3 * 4 * 4  # 6 frames of 56^2: 3 temporal groups of 4 x 4 patches
    for r in rows:
        n = r["streams"]
        assert r["sent"] == r["done"] == n * seconds and r["unfinished"] == r["errors"] == 0, r
        assert 0 < r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert r["pass"] and 0 < r["chunks_per_s"] <= n and r["served_per_s"] > 0
        assert r["prompt_tokens"] == flops["prompt_tokens"]  # the server saw the prompt the FLOPs count
        assert r["prefill_ms"] > 0 and (r["decode_ms"] > 0) == (r["mode"] == "generate")
    assert meta["hf"]["chunks"] == 4 and meta["hf"]["chunks_per_s"] > 0
    assert flops["generate"] > flops["head"] > flops["vision"] > 0 and meta["matmul_tflops"] > 0
    for s in meta["summary"]:
        assert s["max_streams"] == counts[-1] and 0 < s["matmul_fraction"] < 1
        assert s["compute_floor_chunks_per_s"] > 0 and s["vs_hf"] > 0
    assert meta["device"] == "cpu" and meta["date"] and meta["command"]
    # the CPU has neither a sustained GPU rate nor a device timeline: the floor at the burst rate alone
    assert meta["matmul_sustained"] is None and set(meta["floor"]) == {"burst_ms"}
    assert meta["floor"]["burst_ms"] == pytest.approx(flops["head"] / meta["matmul_tflops"] / 1e9)
    in_process = meta["engine_only"]  # the same chunks on the engine without RPC
    assert in_process["full_batch"]["chunks"] == 8 and in_process["full_batch"]["chunks_per_s"] > 0
    ab = in_process["encode_ahead_ab"]  # the full batch again, encoding ahead off and on in turns
    assert [r["encode_ahead"] for r in ab] == [False, True, False, True] and all(r["chunks_per_s"] > 0 for r in ab)
    (paced,) = in_process["paced"]
    assert paced["sent"] == 2 * seconds and paced["served_per_s"] > 0 and 0 < paced["p50_ms"] <= paced["p95_ms"]

    out = tmp_path / "cpu"
    with open(out / "streams.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [(t["mode"], int(t["streams"]), float(t["p95_ms"])) for t in table] == \
        [(r["mode"], r["streams"], pytest.approx(r["p95_ms"])) for r in result["streams"]]
    saved = _strict_json((out / "streams.json").read_text())
    assert saved["meta"]["summary"][0]["mode"] == "head" and len(saved["rows"]) == len(result["streams"])
    assert saved["meta"]["job"]["model"] == "qwen2_vl_tiny" and saved["meta"]["job"]["dtype"] == "float32"
    assert (out / "streams.png").stat().st_size > 1000


def test_streams_suite_with_the_loop_on_a_thread(vlora_home, tmp_path, one_thread):
    """rpc.engine_process=false's way: each point a fresh server over the bench's engine, the cold
    point's server warming the engine up on its own thread before it serves."""
    cfg = compose("bench", ["bench.suite=streams", "bench.streams.device=cpu", "bench.streams.model=qwen2_vl_tiny",
                            "bench.streams.image_size=56", "bench.streams.stream_counts=[1]", "bench.streams.seconds=1",
                            "bench.streams.warmup_s=0", "bench.streams.warmup_point_s=0", "bench.streams.refine=0",
                            "bench.streams.target_ms=5000", "bench.streams.drain_s=20", "bench.streams.chunk_pool=2",
                            "bench.streams.adapters=1", "bench.streams.max_batch_size=4", "bench.streams.modes=[head]",
                            "bench.streams.max_tokens_per_step=1024", "bench.streams.hf_baseline=false",
                            "bench.streams.engine_only=false", "bench.streams.cold_streams=2",
                            "bench.streams.cold_seconds=1", "bench.streams.engine_process=false",
                            "bench.streams.window_counts=[1]", "bench.streams.window_seconds=3",
                            f"bench.out_dir={tmp_path}"])
    result = run(cfg)
    rows, meta = result["streams"], result["meta"]
    assert [(r["point"], r["streams"]) for r in rows] == [("cold", 2), ("warm", 1), ("warm", 2), ("window", 1)]
    assert rows[-1]["sent"] == 3 > rows[1]["sent"]  # the long window's chunks: window_seconds of them, not seconds'
    assert [s["max_streams"] for s in meta["summary"]] == [2]  # the window is not a point of the search
    assert not any(r["engine_process"] for r in rows) and all(r["done"] == r["sent"] > 0 for r in rows)
    assert meta["warm_up"]["thread"] == "server" and meta["start_s"] >= meta["engine_load_s"] + rows[0]["server_warm_up_s"]
    assert rows[0]["steps"] < meta["warm_up"]["steps"]


def test_floor_at_the_burst_and_the_sustained_matmul_rate():
    from bench.streams_report import floor_summary

    flops = {"head": 14.43e12}
    got = floor_summary(flops, 790.0, {"tflops": 641.0, "sm_clock_mhz": 1605}, {"full_batch": {"gpu_ms_per_chunk": 26.6}})
    assert got["burst_ms"] == pytest.approx(18.27, abs=0.01) and got["sustained_ms"] == pytest.approx(22.51, abs=0.01)
    assert got["vs_burst"] == pytest.approx(26.6 / got["burst_ms"]) and got["vs_sustained"] == pytest.approx(26.6 / got["sustained_ms"])
    assert floor_summary(flops, 790.0, None, None) == {"burst_ms": pytest.approx(18.27, abs=0.01)}


def test_search_stops_at_the_first_failure_then_bisects():
    def searched(capacity, counts, refine):
        runs = []

        def point(n):
            runs.append(n)
            return {"streams": n, "pass": n <= capacity, "p95_ms": math.nan}

        rows = search(point, counts, refine)
        assert [r["streams"] for r in rows] == sorted(runs)
        return runs

    assert searched(27, (8, 16, 24, 32, 40), 2) == [8, 16, 24, 32, 28, 26]
    assert searched(3, (8, 16), 3) == [8, 4, 2, 3]  # none passes: bisect below the first count
    assert searched(99, (8, 16), 2) == [8, 16]  # all pass: nothing to refine


def test_a_growing_backlog_fails_a_point_its_window_passes():
    """38 cameras sent 38 chunks/s to a server serving 36: each second adds 2 chunks of backlog, about 55 ms
    of latency; an 8 s window ends under the 1 s target, a minute would not. A server keeping up shows next
    to no trend, however noisy its latencies."""
    from types import SimpleNamespace

    from bench.streams_load import _row, latency_trend

    rng = np.random.default_rng(0)

    def records(n, growth_ms_per_s):
        sent = np.sort(rng.uniform(0, 8, n))
        latency = 400 + growth_ms_per_s * sent + rng.normal(0, 80, n)
        return [{"stream": i % 38, "chunk": i, "sent": t, "done": t + ms / 1e3, "latency_ms": ms, "measured": True,
                 "finished": True, "prompt_tokens": 800} for i, (t, ms) in enumerate(zip(sent, latency))]

    growing, steady = records(304, 55.0), records(288, 0.0)
    assert 40 < latency_trend(growing) < 55  # the slope less twice its error
    assert latency_trend(steady) < 5  # noise alone: a few ms per s at most, 0 most often
    assert latency_trend(growing[:2]) == 0.0
    job = SimpleNamespace(target_ms=1000.0, sustain_s=60.0)
    for recs, passes in ((growing, False), (steady, True)):
        row = _row(job, "head", 38, recs, Counter(), 0.0, 8)
        assert row["p95_ms"] < 1000 and row["pass"] is passes
        assert (row["projected_p95_ms"] > 1000) is not passes
    window_only = _row(SimpleNamespace(target_ms=1000.0, sustain_s=0.0), "head", 38, growing, Counter(), 0.0, 8)
    assert window_only["pass"] and window_only["projected_p95_ms"] == window_only["p95_ms"]
    with pytest.raises(ValueError, match="sustain_s"):
        StreamsBenchJob(sustain_s=-1)


def test_job_names_bad_fields():
    with pytest.raises(ValueError, match="modes"):
        StreamsBenchJob(modes=("lm_head",))
    with pytest.raises(ValueError, match="image_size"):
        StreamsBenchJob(image_size=50)
    with pytest.raises(ValueError, match="stream_counts"):
        StreamsBenchJob(stream_counts=(0, 8))
    with pytest.raises(ValueError, match="window_seconds"):
        StreamsBenchJob(window_counts=(8,), window_seconds=0)


def test_every_send_differs_after_jpeg():
    """Pooled chunks come round again: each send's stamp must survive the codec, or the server's caches
    answer a repeat and the point measures less work than live cameras bring."""
    from bench.streams_load import _stamped
    from serve.rpc.wire import encode_frame

    chunk = np.random.default_rng(0).integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)
    sends = [[encode_frame(f, "jpeg")[1] for f in _stamped(chunk, serial)] for serial in (1, 2, 256, 257)]
    assert all(len({s[t] for s in sends}) == 4 for t in range(4))  # every frame of every send its own
    static = [[encode_frame(f, "jpeg")[1] for f in _stamped(chunk, serial, every_frame=False)] for serial in (1, 2)]
    assert static[0][0] != static[1][0] and static[0][1:] == static[1][1:]


def test_gc_pauses_are_counted_while_watched():
    import gc

    from bench.streams_load import gc_pauses

    with gc_pauses() as watch:
        gc.collect()
        gc.collect(0)
    gc.collect()  # no longer watched
    summary = watch.summary()
    assert summary["collections"] == 2 and summary["full"] == 1 and summary["full_ms"] >= 0


def test_kernel_kinds_add_up_a_profiles_time_per_chunk():
    import torch

    from bench.streams_engine import kernel_kinds

    x, w = torch.randn(64, 32), torch.randn(32, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.nn.functional.layer_norm(x @ w, (32,))
    kinds, top = kernel_kinds(prof, chunks=2, cuda=False)
    assert kinds["matmul"] > 0 and kinds["norm"] > 0
    assert top[0]["ms_per_chunk"] >= top[-1]["ms_per_chunk"] and {t["kind"] for t in top} >= {"matmul", "norm"}
