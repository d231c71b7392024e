"""`python -m bench.engine_pipe` at a tiny size: both framings deliver every event and the file is written."""

from __future__ import annotations

import json

from bench.engine_pipe import main


def test_the_pipe_bench_times_both_framings(tmp_path):
    result = main(["--events", "300", "--busy", "0", "--step", "64", "--pause-ms", "0", "--repeats", "1",
                   "--out", str(tmp_path)])
    (row,) = result["rows"]
    assert row["events"] == 300 and row["one_per_write_events_per_s"] > 0 and row["batched_events_per_s"] > 0
    assert json.loads((tmp_path / "engine_pipe.json").read_text())["rows"][0]["busy_threads"] == 0
