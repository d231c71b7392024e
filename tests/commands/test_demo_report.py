"""The demo's report tells the truth about every target: from small app reports made by the apps'
own code (routes resolved against a real fusion manifest, stream metrics, the retrieval summary),
written to files and read back, every task gets its target, score, verdict and the router's
reason in one line; unparsed answers are counted; the retrieval table keeps its route column;
the plot draws the targets and labels every mark; the console ends with one line per miss."""

from __future__ import annotations

import json

from adapters.manifest import write_manifest
from apps.common.routing import ServerCaps, load_manifest, resolve_route
from apps.video_analytics.metrics import StreamMetrics
from apps.video_analytics.tasks import TaskSpec
from apps.visual_retrieval.report import summarise
from fusion import Domain, FusedAdapter, FusionResult
from vlora.commands.demo import write_report
from vlora.commands.demo_plot import plot
from vlora.commands.demo_report import missed_lines, report_lines, retrieval_rows, stream_rows, task_targets

STREAMS = [  # as conf/video_analytics.yaml writes them
    {"name": "cam0", "source": "synthetic:0", "tasks": [{"task": "count", "accuracy_target": 0.45, "latency_ms": 1000},
                                                         {"task": "direction", "accuracy_target": 0.6}]},
    {"name": "cam1", "source": "synthetic:1", "tasks": [{"task": "count", "accuracy_target": 0.45}]},
    {"name": "file", "source": "clip.mp4", "tasks": [{"task": "detect", "accuracy_target": 0.5}]}]


def _manifest(tmp_path) -> dict:
    doms = [Domain("count_vehicles", "count", 0.45, 9), Domain("qa", "lm", 0.4, 9)]
    fused = FusedAdapter(0, "fused_0", ["count_vehicles", "qa"], {"count_vehicles": 0.58, "qa": 0.5},
                         {"count_vehicles": 0.45, "qa": 0.4}, True, None)
    path = write_manifest(FusionResult([fused], [], doms), tmp_path / "fused",
                          questions={"count_vehicles": "How many vehicles are there?"},
                          media={"count_vehicles": "image", "qa": "image"})
    return load_manifest(path)


def _app_reports(tmp_path) -> tuple[dict, dict]:
    """A video analytics and a visual retrieval report as the apps write them, read back from files."""
    manifest, caps = _manifest(tmp_path), ServerCaps(frozenset({"fused_0"}))
    # (stream, task) -> (correct answers, unparsed, of answers, ground truth on the source)
    answers = {("cam0", "count"): (7, 0, 10, True), ("cam0", "direction"): (1, 6, 10, True),
               ("cam1", "count"): (3, 1, 10, True), ("file", "detect"): (0, 0, 10, False)}
    streams = {}
    for s in STREAMS:
        specs = [TaskSpec(**t) for t in s["tasks"]]
        metrics = StreamMetrics(s["name"], [t.label for t in specs], {t.label for t in specs if t.task == "detect"})
        for t in specs:
            correct, unparsed, n, truth = answers[(s["name"], t.label)]
            for i in range(n):
                score = {"correct": i < correct} if truth else None
                metrics.task_result(t.label, 100.0 + i, 90.0, score, parsed=i >= unparsed, head=False, slo_ms=t.latency_ms)
            metrics.chunk_done(0, 100.0, 1.0, True)
        snap = metrics.snapshot({"dropped": 0})
        snap["routes"] = {t.label: resolve_route(t.key, t.accuracy_target, manifest, caps, "auto", None,
                                                 t.question()).to_dict() for t in specs}
        streams[s["name"]] = snap
    if streams["cam1"]["routes"]["count"]["adapter"] != "fused_0":
        raise AssertionError("cam1 counts on the adapter: its miss is the adapter's")
    results = [{"kind": "count", "latency_ms": 50.0, "scores": {"correct": 1.0}},
               {"kind": "ground", "latency_ms": 70.0, "scores": {"correct": 0.0}},
               {"kind": "qa", "latency_ms": 20.0, "scores": {}}]  # a question without a known answer
    vr = summarise(results)
    vr["routes"] = {"count: How many vehicles are there?": resolve_route("count", 0.0, manifest, caps, "auto", None,
                                                                          "How many vehicles are there?").to_dict(),
                    "ground": resolve_route("detect", 0.0, manifest, caps, "auto").to_dict(),
                    "qa": resolve_route("qa", 0.0, manifest, caps, "never").to_dict()}
    (tmp_path / "va.json").write_text(json.dumps({"duration_s": 10.0, "streams": streams}))
    (tmp_path / "vr.json").write_text(json.dumps(vr))
    return json.loads((tmp_path / "va.json").read_text()), json.loads((tmp_path / "vr.json").read_text())


def _report(tmp_path) -> dict:
    va, vr = _app_reports(tmp_path)
    domains = [{"domain": "count_vehicles", "task": "count", "requirement": 0.45, "fused": 0.58, "fused_adapter": "fused_0",
                "meets_requirement": True},
               {"domain": "exists_bus", "task": "binary", "requirement": 0.8, "fused": 0.7, "fused_adapter": "fused_0",
                "meets_requirement": False}]
    report = {"model": "qwen2_vl_tiny", "domains": domains, "not_measured": {}, "streams": stream_rows(va, task_targets(STREAMS)),
              "retrieval": retrieval_rows(vr), "engine": {"policy": "v_lora", "adapters": 1, "mode_switches": 0,
                                                         "switch_ms_total": 0.0, "steps_by_mode": {}},
              "seconds": {"offline": 1.0, "total": 2.0}}
    report["missed"] = missed_lines(report)
    return report


def test_every_task_has_its_target_score_verdict_and_reason_in_one_line(tmp_path):
    report = _report(tmp_path)
    verdicts = {(r["stream"], r["task"]): (r["route"], r["target"], r["accuracy"], r["verdict"]) for r in report["streams"]}
    assert verdicts == {("cam0", "count"): ("fused_0/head", 0.45, 0.7, "MET"),
                        ("cam0", "direction"): ("base/generate", 0.6, 0.1, "NO ADAPTER"),
                        ("cam1", "count"): ("fused_0/head", 0.45, 0.3, "MISSED"),
                        ("file", "detect"): ("base/generate", 0.5, None, "NOT SCORED")}
    text = "\n".join(report_lines(report))
    assert "None" not in text
    lines = {line[2:].split(":")[0]: line for line in text.splitlines() if line.startswith("- ")}
    assert set(lines) == {"cam0 count", "cam0 direction", "cam1 count", "file detect", "retrieval count",
                          "retrieval ground", "retrieval qa"}
    assert lines["cam0 count"].startswith("- cam0 count: MET, accuracy 0.700 >= target 0.45 on fused_0/head; manifest: "
                                          "fused_0 (count_vehicles, accuracy 0.58)")
    assert ("- cam0 direction: NO ADAPTER, accuracy 0.100 < target 0.6 on base/generate; the manifest knows no domain "
            "or task 'direction': base model; 6 of 10 answers unparsed") in lines["cam0 direction"]
    assert lines["cam1 count"].startswith("- cam1 count: MISSED, accuracy 0.300 < target 0.45 on fused_0/head")
    assert "1 of 10 answers unparsed" in lines["cam1 count"]
    assert lines["file detect"].startswith("- file detect: NOT SCORED, F1 not measured")
    assert "no ground truth on this source" in text, "the empty accuracy cell says why"
    header = next(line for line in text.splitlines() if line.startswith("stream "))
    assert header.split()[:6] == ["stream", "task", "route", "target", "accuracy", "verdict"] and "unparsed" in header
    # the retrieval table keeps the route column the console shows, and its reasons
    kind_header = next(line for line in text.splitlines() if line.startswith("kind "))
    assert kind_header.split()[:2] == ["kind", "route"]
    assert "- retrieval ground: NO TARGET, accuracy 0.000 (no target) on base/generate; the manifest knows no domain " \
           "or task 'detect': base model" in text
    assert "retrieval count: NO TARGET, accuracy 1.000 (no target) on fused_0/head" in text
    assert "- retrieval qa: NOT SCORED, accuracy not measured on fused_0/generate" in text
    assert "accuracy: no query of this kind had a known answer" in text


def test_the_report_ends_with_one_line_per_missed_target_on_the_console_and_in_its_files(tmp_path, capsys):
    report = _report(tmp_path)
    write_report(report, tmp_path / "demo")
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == report["missed"] and len(report["missed"]) == 3
    assert out[-3] == "Missed requirement: exists_bus fused 0.7 < 0.8 (adapter fused_0)"
    assert out[-2].startswith("Missed target: cam0 direction: NO ADAPTER, accuracy 0.100 < target 0.6")
    assert out[-1].startswith("Missed target: cam1 count: MISSED, accuracy 0.300 < target 0.45")
    assert out[-4].startswith("report: ") and "demo.log" in out[-4]
    saved = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert saved["missed"] == report["missed"] and saved["streams"][1]["unparsed"] == 6
    assert (tmp_path / "demo" / "report.md").read_text().rstrip().splitlines()[-3:] == report["missed"]
    assert (tmp_path / "demo" / "report.png").stat().st_size > 0


def test_every_target_met_is_said_in_one_line(tmp_path, capsys):
    report = _report(tmp_path)
    report["domains"] = report["domains"][:1]
    report["streams"] = [r for r in report["streams"] if r["verdict"] not in ("MISSED", "NO ADAPTER")]
    report["missed"] = missed_lines(report)
    write_report(report, tmp_path / "demo")
    assert capsys.readouterr().out.splitlines()[-1] == "Every target met (1 domain requirements, 1 online targets)."


def test_the_plot_draws_targets_and_labels_every_mark(tmp_path):
    report = _report(tmp_path)
    legends = plot(report, tmp_path / "report.png")
    assert "latency target" in legends["latency"] and {"p50", "p95"} <= set(legends["latency"])
    assert {"MET", "MISSED", "NO ADAPTER", "accuracy target"} <= set(legends["score"])
    assert legends["retrieval"] == ["accuracy", "p50 latency (ms)"]
    # retrieval alone still plots (no stream ran)
    assert plot({**report, "streams": []}, tmp_path / "only_retrieval.png")
    assert (tmp_path / "only_retrieval.png").stat().st_size > 0
