"""The streams suite's point over HTTP (bench/streams_http.py), on the tiny model: the cameras' process
sends its chunks as video frames through the OpenAI-compatible API, every chunk is answered, the row
is the RPyC point's with the server's timing filled in, and a job with `transport = "http"` takes
this path from bench.streams_load.run_point."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")


def test_a_streams_point_over_http(tiny_zoo):
    from bench.streams import StreamsBenchJob
    from bench.streams_load import run_point
    from serve import Engine, EngineConfig

    engine = Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(device="cpu", num_kv_blocks=96))
    job = StreamsBenchJob(model="qwen2_vl_tiny", device="cpu", image_size=56, frames_per_chunk=2, answer_tokens=2,
                          seconds=1.0, warmup_s=0.0, drain_s=20.0, target_ms=20_000.0, modes=("generate",),
                          engine_only=False, hf_baseline=False)
    job.transport = "http"  # what a `transport` option of the suite would set
    chunks = [np.random.default_rng(i).integers(0, 256, (2, 56, 56, 3), dtype=np.uint8) for i in range(2)]
    row = run_point(engine, job, "generate", 2, chunks, ["base"])  # "base": the HTTP server's base model id
    assert row["transport"] == "http" and row["errors"] == 0, row["error_kinds"]
    assert row["sent"] == row["done"] == 2 and row["unfinished"] == 0 and row["settled"]
    assert not math.isnan(row["frame_decode_ms"]) and not math.isnan(row["prefill_ms"])  # vlora.timing
    # the same engine-side columns as an RPyC point: items through the tower (a chunk's frames are one video) and GC
    assert row["items_encoded"] == row["done"] and row["items_encoded_ahead"] >= 0 and "collections" in row["gc"]


def test_the_transport_comparison_runs_from_its_command_line(tmp_path, capsys):
    # `python -m bench.streams_http`: one engine, warmed up before its first point (else that point's server
    # answers "warming"), both transports at each count, transports.csv written with the HTTP/RPyC ratios
    import csv

    from bench.streams_http import main

    main(["--model", "qwen2_vl_tiny", "--device", "cpu", "--image-size", "56", "--counts", "1", "--seconds", "1",
          "--repeats", "2", "--out-dir", str(tmp_path)])
    with open(tmp_path / "cpu" / "transports.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["transport"] for r in rows] == ["rpc", "http"] * 2
    # the second repeat sends HTTP first: a transport measured always second would carry the first one's leftovers
    assert [(r["repeat"], r["order"]) for r in rows] == [("0", "0"), ("0", "1"), ("1", "1"), ("1", "0")]
    assert all(r["errors"] == "0" and r["unfinished"] == "0" for r in rows)
    assert float(rows[1]["chunks_per_s_vs_rpc"]) > 0
    assert "transport=http" in capsys.readouterr().out
