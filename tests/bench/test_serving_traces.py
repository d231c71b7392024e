"""bench.serving_traces: a results folder keeps each replayed trace as the seeded spec that
generates it, and rebuilding checks the file byte for byte against the run's digest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.serving_traces import main, rebuild, record
from serve.orchestrator import WorkloadSpec, generate, read_trace

RESULTS = Path(__file__).resolve().parents[2] / "results"


def test_record_keeps_the_spec_and_rebuild_writes_the_same_trace(tmp_path):
    spec = WorkloadSpec(rate=5.0, duration_s=3.0, seed=7)
    entry = record(tmp_path / "run", "trace_a.jsonl", spec)
    record(tmp_path / "run", "trace_b.jsonl", WorkloadSpec(rate=5.0, duration_s=3.0, seed=8))
    index = json.loads((tmp_path / "run" / "traces.json").read_text())
    assert sorted(index) == ["trace_a.jsonl", "trace_b.jsonl"] and index["trace_a.jsonl"] == json.loads(json.dumps(entry))
    assert not list((tmp_path / "run").glob("*.jsonl")), "only the index stays in the results folder"
    path = rebuild(tmp_path / "run" / "traces.json", "trace_a.jsonl", tmp_path / "out")
    assert read_trace(path) == generate(spec) and entry["requests"] == len(generate(spec))


def test_rebuild_refuses_a_changed_generator_and_an_unknown_name(tmp_path):
    record(tmp_path, "t.jsonl", WorkloadSpec(rate=5.0, duration_s=3.0, seed=1))
    index = json.loads((tmp_path / "traces.json").read_text())
    index["t.jsonl"]["sha256"] = "0" * 64  # what a drifted generator looks like from the index's side
    (tmp_path / "traces.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="the workload generator changed"):
        rebuild(tmp_path / "traces.json", "t.jsonl", tmp_path / "out")
    with pytest.raises(ValueError, match="no trace 'u.jsonl'; it has \\['t.jsonl'\\]"):
        rebuild(tmp_path / "traces.json", "u.jsonl", tmp_path / "out")


def test_every_committed_trace_rebuilds_from_its_spec(tmp_path):
    indexes = sorted(RESULTS.glob("**/traces.json"))
    assert indexes and not list(RESULTS.glob("**/trace*.jsonl")), "traces are committed as specs, not JSONL"
    for index in indexes:
        main([str(index), "--out", str(tmp_path / index.parent.name)])  # raises on any digest mismatch
        names = json.loads(index.read_text())
        assert sorted(p.name for p in (tmp_path / index.parent.name).iterdir()) == sorted(names)
