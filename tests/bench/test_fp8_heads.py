"""`vlora bench bench.suite=fp8 bench.fp8.heads_only=true` on the CPU (tiny model, a handful of world items, FP8
let through by serve.models.fp8.ALLOW_CPU): adapters trained on the world's truth answer the same held-out
items in bf16 and FP8, unmerged and merged; a row per domain and mode with agreement and both precisions'
scores against the truth, the bf16 rerun agreeing exactly, caption tokens compared; an adapters_dir is
measured as given; bad options are refused before anything is built."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from bench.fp8 import Fp8BenchJob, run_fp8_bench
from bench.fp8_heads_data import adapters_from_dir, trained_adapters
from serve.models import fp8 as fp8_models
from vlora.commands.bench import run
from vlora.config import compose

SMALL = ["bench.fp8.device=cpu", "bench.fp8.heads_items=3", "bench.fp8.heads_train_items=6", "bench.fp8.heads_epochs=1",
         "bench.fp8.heads_image_size=64", "bench.fp8.heads_captions=2", "bench.fp8.heads_caption_tokens=4"]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only waits (see tests/adapter_cases.py)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    monkeypatch.setattr(fp8_models, "ALLOW_CPU", True)


def _bench(tmp_path, *overrides) -> dict:
    return run(compose("bench", ["bench.suite=fp8", "bench.fp8.heads_only=true", *SMALL, *overrides,
                                 f"bench.out_dir={tmp_path}"]))


def test_heads_section_per_domain_and_mode(vlora_home, tmp_path, one_thread, fp8_on_cpu):
    # the default domains, and direction: a clip domain, its frames through the engine's video input
    rows = _bench(tmp_path, "bench.fp8.heads_domains=[exists_bus,count_vehicles,class_main,detect_car,direction]")["fp8"]
    heads = {(r["domain"], r["mode"], r["precision"]): r for r in rows if r["kind"] == "head"}
    domains = {"exists_bus": "binary", "count_vehicles": "count", "class_main": "classify", "detect_car": "detect",
               "direction": "classify"}
    assert set(heads) == {(d, m, "fp8") for d in domains for m in ("unmerged", "merged")} | {
        (d, "unmerged", "bf16 rerun") for d in domains}
    for (domain, mode, precision), r in heads.items():
        assert r["section"] == "heads" and r["task"] == domains[domain] and r["items"] == 3
        assert 0 <= r["agreement"] <= 1 and 0 <= r["bf16_truth"] <= 1 and r["truth_from"] == "world truth"
        assert r["differ"] == round(3 * (1 - r["agreement"])) and r["target_met"] == (r["differ"] == 0)
        assert r["truth_metric"] == ("f1@0.5" if domain == "detect_car" else "top1")
        # the baseline beside the scores: always the commonest true answer (none for boxes)
        assert (r["majority_truth"] is None) == (domain == "detect_car")
        if domain != "detect_car":
            assert 1 / 3 <= r["majority_truth"] <= 1  # 3 items: the commonest answer is at least one of them
        if precision == "fp8":
            assert 0 <= r["fp8_truth"] <= 1
        else:  # the same bf16 engine on the same batch: exactly the same answers
            assert r["agreement"] == 1 and r["conf_mad"] == 0
    assert heads["count_vehicles", "merged", "fp8"]["count_mad"] >= 0
    assert 0 <= heads["detect_car", "unmerged", "fp8"]["box_f1"] <= 1
    captions = {r["mode"]: r for r in rows if r["kind"] == "caption"}
    assert set(captions) == {"unmerged", "merged"}
    for r in captions.values():
        assert r["prompts"] == 2 and 0 <= r["token_agreement"] <= 1
        assert (r["top2_margin_min"] is None) == (r["diverged"] == 0)
    out = tmp_path / "cpu"
    report = (out / "fp8.md").read_text()
    assert "## Trained adapters' head answers, FP8 against bf16" in report and "| differ | target_met |" in report
    with open(out / "fp8.csv", newline="") as f:
        assert {r["section"] for r in csv.DictReader(f)} == {"heads"}
    assert len(json.loads((out / "fp8.json").read_text())["rows"]) == len(rows)


def test_adapters_dir_is_measured_as_given(vlora_home, tmp_path, one_thread, fp8_on_cpu):
    """One adapter directory (meta.json) and a fusion manifest's folder naming it give the same adapter."""
    job = Fp8BenchJob(device="cpu", heads_domains=("exists_bus",), heads_items=2, heads_train_items=4,
                      heads_epochs=1, heads_image_size=64)
    adapter = trained_adapters(job, tmp_path / "work", open("/dev/null", "w"))[0]
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "manifest.json").write_text(json.dumps({
        "adapters": [{"name": "fused_0", "path": str(adapter.path), "domains": ["exists_bus"]}],
        "tasks": {"exists_bus": {"adapter": "fused_0", "head": "exists_bus", "task": "binary", "accuracy": 0.5,
                                 "requirement": 0.5, "met": True}},
        "order": ["exists_bus"], "created_by": "vlora fusion"}))
    assert [a.path for a in adapters_from_dir(fused)] == [adapter.path]
    rows = _bench(tmp_path / "out", f"bench.fp8.adapters_dir={fused}", "bench.fp8.heads_captions=0")["fp8"]
    assert {(r["domain"], r["mode"], r["precision"]) for r in rows} == {
        ("exists_bus", "unmerged", "fp8"), ("exists_bus", "merged", "fp8"), ("exists_bus", "unmerged", "bf16 rerun")}
    assert all(r["items"] == 2 for r in rows)


@pytest.mark.parametrize("override,match", [
    ("bench.fp8.heads_items=0", "heads_items=0: must be an int >= 1"),
    ("bench.fp8.heads_image_size=65", "heads_image_size=65: must be even"),
    ("bench.fp8.heads_domains=[exists_bus,plates]", r"heads_domains=\['exists_bus', 'plates'\]: each must be one of"),
    ("bench.fp8.adapters_dir=/no/such/dir", "adapters_dir='/no/such/dir' is not a directory"),
])
def test_bad_options_are_refused_before_anything_is_built(vlora_home, tmp_path, fp8_on_cpu, override, match):
    with pytest.raises(ValueError, match=match):
        _bench(tmp_path, override)
    assert not (tmp_path / "cpu").exists()  # no results folder, no model, no world


def test_a_folder_without_adapters_is_refused(tmp_path, fp8_on_cpu):
    with pytest.raises(ValueError, match="neither an adapter .meta.json. nor a fusion manifest's folder"):
        run_fp8_bench(Fp8BenchJob(device="cpu", heads_only=True, adapters_dir=str(tmp_path), out_dir=str(tmp_path)))
    assert not (tmp_path / "cpu").exists()


def test_the_cpu_is_refused_without_the_test_switch(tmp_path):
    assert fp8_models.ALLOW_CPU is False
    with pytest.raises(ValueError, match="measures FP8 head answers on a GPU"):
        run_fp8_bench(Fp8BenchJob(device="cpu", heads=True, out_dir=str(tmp_path)))
    assert not Path(tmp_path / "cpu").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 needs a GPU of compute capability >= 8.9")
def test_heads_section_on_gpu(vlora_home, tmp_path):
    """The GPU path (training with bf16 autocast, CUDA graphs, the FP8 GEMMs) at the CPU test's sizes."""
    rows = run(compose("bench", ["bench.suite=fp8", "bench.fp8.heads_only=true", *SMALL[1:],
                                 f"bench.out_dir={tmp_path}"]))["fp8"]
    heads = [r for r in rows if r["kind"] == "head"]
    assert len(heads) == 12 and all(0 <= r["agreement"] <= 1 for r in heads)
    assert all(r["agreement"] == 1 for r in heads if r["precision"] == "bf16 rerun")


def test_the_majority_baseline_is_the_commonest_true_answers_share():
    from types import SimpleNamespace

    from bench.fp8_heads import majority_score

    items = [SimpleNamespace(truth={"count": c, "label": lb}) for c, lb in [(2, "car"), (2, "bus"), (0, "car"),
                                                                              (2, "car")]]
    assert majority_score("count", items) == 0.75 and majority_score("classify", items) == 0.75
    assert majority_score("binary", items[1:3]) == 0.5 and majority_score("detect", items) is None
