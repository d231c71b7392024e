"""The main job end to end, in a smaller setting than the README default: two distilled domains
with cheap teachers, fusion on the un-pretrained tiny model, the server with the fused adapters,
two synthetic cameras and a few retrieval queries. Its report is checked for content."""

from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from vlora.commands import demo
from vlora.config import compose

DOMAINS = "[exists_bus,exists_truck]"


def _small_demo():
    cfg = compose("demo")
    cfg.demo.profile = "cpu"  # the same small job on a machine with CUDA
    cfg.demo.offline = ["offline.per_domain=false", "offline.all_in_one=false", "offline.compare_lm_head=null",
                        "offline.other_orders=[]",
                        f"distill.only={DOMAINS}", f"fusion.only={DOMAINS}", "fusion.domains.exists_bus=0.3",
                        "+fusion.domains.exists_truck=0.1", "train.base=model", "train.epochs=1",
                        "train.allow_random_base=true",  # the un-pretrained tiny model on purpose (fast)
                        # its adapters learn nothing in one epoch: kept (flagged) so the plumbing runs
                        "fusion.accept_at_baseline=true",
                        "distill.domains.exists_bus.size=40", "distill.domains.exists_truck.size=40"]
    cfg.demo.video_analytics = ["duration_s=6", "streams.0.width=112", "streams.0.height=112", "streams.0.sample_fps=8",
                                "streams.1.width=112", "streams.1.height=112", "streams.1.sample_fps=8",
                                "streams.0.annotate=null"]
    cfg.demo.visual_retrieval = ["queries_per_image=1", "max_new_tokens=6"]
    cfg.demo.world = ["world.n_images=3", "world.n_clips=0"]
    return cfg


def _number(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_the_main_job_runs_end_to_end_and_reports_every_stream_and_task(vlora_home, capfd):
    report = demo.run(_small_demo())
    saved = json.loads((vlora_home / "results" / "demo" / "report.json").read_text())
    assert saved["streams"] == report["streams"]
    assert (vlora_home / "results" / "demo" / "report.png").stat().st_size > 0
    # offline: both domains fused into adapters that the server loaded
    assert {d["domain"] for d in report["domains"]} == {"exists_bus", "exists_truck"}
    for d in report["domains"]:  # each fused score with its interval over the eval split it was scored on
        lo, hi = map(float, d["fused_95"].split("-"))
        sizes = json.loads((vlora_home / "datasets" / d["domain"] / "domain.json").read_text())["sizes"]
        assert d["eval_items"] == sizes["eval"] > 0 and lo <= d["fused"] <= hi
    assert report["engine"]["adapters"] == report["offline"]["adapters"]["fused"] >= 1
    # the manifest records the question each domain's head answers, for routing (apps.common.routing)
    manifest = json.loads((vlora_home / "adapters" / "fused" / "manifest.json").read_text())
    for name in ("exists_bus", "exists_truck"):
        info = json.loads((vlora_home / "datasets" / name / "domain.json").read_text())
        assert info["question"] and manifest["tasks"][name]["question"] == info["question"]
        assert manifest["tasks"][name]["media"] == info["media"] == "image"  # a stream sends it one frame
    # every configured stream and task is in the report, with numeric, plausible numbers
    assert {(r["stream"], r["task"]) for r in report["streams"]} == {("cam0", "count"), ("cam0", "direction"),
                                                                      ("cam1", "detect")}
    for row in report["streams"]:
        assert row["chunks"] >= 1 and row["dropped"] >= 0
        assert _number(row["p50_ms"]) and 0 < row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"] < 60_000
        assert _number(row["accuracy"]) and 0.0 <= row["accuracy"] <= 1.0
        # the app's default tasks, which neither fused domain serves: on the base model, and why
        assert row["route"] == "base/generate" and row["verdict"] in ("MET", "NO ADAPTER")
        assert row["reason"] == f"the manifest knows no domain or task {row['task']!r}: base model"
        assert 0 <= row["unparsed"] <= row["answers"] and row["target"] > 0
    kinds = {r["kind"] for r in report["retrieval"]}
    assert kinds and all(r["errors"] == 0 and 0.0 <= r["accuracy"] <= 1.0 and r["p50_ms"] > 0
                         for r in report["retrieval"])
    assert report["engine"]["steps"] > 0 and report["engine"]["generated_tokens"] > 0
    console = capfd.readouterr()
    out = console.out
    assert "Video analytics (" in out and "cam1" in out and "Engine: policy v_lora" in out
    assert out.rstrip().splitlines()[-len(report["missed"] or [1]):] == (report["missed"] or [out.rstrip().splitlines()[-1]])
    assert all(line.startswith("Missed target: ") for line in report["missed"])
    # quiet: the stages' own output is in the log, the console has a line per stage
    log = (vlora_home / "results" / "demo" / "demo.log").read_text()
    assert "Offline stage:" in log and "video_analytics:" in log and "Offline stage:" not in console.err
    assert [line.split("]")[0] for line in console.err.splitlines() if line.startswith("[demo ")] == [
        "[demo 1/4", "[demo 2/4", "[demo 3/4", "[demo 4/4"]
    assert len(console.err.splitlines()) <= 6, console.err


def test_auto_profile_follows_cuda_and_a_bad_profile_is_named():
    import torch

    assert demo.resolve_profile("auto") == ("gpu" if torch.cuda.is_available() else "cpu")
    assert demo.resolve_profile("cpu") == "cpu"
    with pytest.raises(ValueError, match="demo.profile='tpu'"):
        demo.resolve_profile("tpu")


def test_the_gpu_profile_composes_every_stage_on_the_small_model_and_all_domains(monkeypatch, tmp_path):
    """Each stage of the GPU profile composes; the offline stage fuses every distilled domain on the
    small model in a home of its own, sharing the CPU profile's teachers."""
    monkeypatch.setenv("VLORA_HOME", str(tmp_path))
    d = compose("demo").demo
    cpu = compose("offline", demo.stage_overrides(d, "cpu", "offline"))
    off = compose("offline", demo.stage_overrides(d, "gpu", "offline"))
    assert off.model.name == "qwen2_vl_small" and off.paths.home == f"{tmp_path}/gpu"
    assert off.teachers.dir == cpu.teachers.dir == f"{tmp_path}/teachers"
    assert set(off.fusion.only) == set(off.distill.domains)  # direction and detection included
    assert all(dict(r) == {"of_teacher": 0.9} for r in off.fusion.only.values())  # the profile's target
    assert all(off.distill.domains[n].size * off.distill.domains[n].eval_fraction >= 256 for n in off.distill.domains)
    assert off.train.pretrain.mixed_precision == "bf16" and off.train.mixed_precision == "bf16"
    assert dict(off.fusion.epochs) == {"detect_car": 96} and cpu.fusion.epochs is None  # the dense head's
    assert off.distill.world_workers == 14 and cpu.distill.world_workers == 0
    assert off.distill.label_workers == 14 and cpu.distill.label_workers == 1
    from vlora.commands.distill import domain_specs

    specs = {s.name: s for s in domain_specs(off)}  # every domain of the profile parses, copies included
    assert specs["detect_car"].augment == ["hflip"] and not specs["direction"].augment
    assert not any(s.augment for s in domain_specs(cpu)), "the CPU default's datasets keep their fingerprints"
    for stage in ("world", "serve", "video_analytics", "visual_retrieval"):
        c = compose(stage, demo.stage_overrides(d, "gpu", stage))
        assert c.paths.home == f"{tmp_path}/gpu", stage
        if stage != "world":
            assert c.model.name == "qwen2_vl_small" and c.adapters.manifest.startswith(f"{tmp_path}/gpu/"), stage


def test_the_default_demo_streams_only_tasks_its_fused_domains_serve():
    """Each profile's streamed tasks ask what one of its fused domains answers (the domain itself,
    or a domain of the task's type asking the task's question): none goes to the base model for
    want of an adapter (that the adapter then meets its requirement is the offline stage's to say)."""
    from apps.video_analytics import stream_from_dict

    d = compose("demo").demo
    for profile in ("cpu", "gpu"):
        off = compose("offline", demo.stage_overrides(d, profile, "offline"))
        fused = set(off.fusion.only or off.fusion.domains)
        answers = {(off.distill.domains[n].task, off.distill.domains[n].question) for n in fused}
        va = compose("video_analytics", demo.stage_overrides(d, profile, "video_analytics"))
        for s in va.streams:
            for t in stream_from_dict(OmegaConf.to_container(s, resolve=True)).tasks:
                assert t.key in fused or (t.key, t.question()) in answers, (profile, s.name, t.label)
