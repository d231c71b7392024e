"""`vlora loadtest` against its own in-process server on the tiny model, for two seconds."""

from __future__ import annotations

import json

from vlora.commands.loadtest import run
from vlora.config import compose


def test_loadtest_reports_throughput_latency_and_no_errors(tiny_zoo, tmp_path):
    cfg = compose("loadtest", [f"model.path={tiny_zoo['qwen2_vl_tiny']}", "engine.device=cpu",
                               "loadtest.clients=3", "loadtest.duration_s=2", "loadtest.clip_frames=4",
                               "loadtest.frame_side=56", f"loadtest.out={tmp_path}/lt.json"])
    summary = run(cfg)
    assert summary["errors"] == {}
    assert summary["video"]["requests"] + summary["image"]["requests"] >= 3
    assert summary["tokens"] > 0 and json.loads((tmp_path / "lt.json").read_text())["clients"] == 3
    assert summary["server_counters"]["connections_total"] == 3
