"""Streams against a real in-process server on the tiny model: accuracy against the synthetic
world's ground truth, annotated video, hot add / remove, a source that breaks, routing from a
fusion manifest with the head-to-generate fallback, and the `vlora video_analytics` command."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest
from apps_server import MODEL, TOKEN, WORLD, connector, http_server, serving, wait_for
from omegaconf import OmegaConf

from apps.video_analytics import (JsonlSink, Prediction, ServerCaps, StreamManager, StreamMetrics, TaskSpec,
                                  from_text, read_jsonl, resolve_route, stream_from_dict)
from apps.video_analytics.sources import FrameTruth
from world import WorldConfig, render_clip, write_video

FAST = {"world": WORLD, "width": 56, "height": 56, "encoding": "raw"}
TASKS = [{"task": "count"}, {"task": "direction"},
         {"task": "detect", "classes": ["car", "bus", "truck"], "max_tokens": 24}]


@pytest.fixture(scope="module")
def server(tiny_zoo, tmp_path_factory):
    # adapters the tests write under their tmp paths may be loaded at run time
    with serving(tiny_zoo[MODEL], adapter_root=str(tmp_path_factory.getbasetemp())) as s:
        yield s


def _expected(world: WorldConfig, frame: int, size: int) -> dict:
    """Truth of a chunk whose middle frame is `frame` of the feed, computed from render_clip alone."""
    clip = render_clip(world, frame // world.clip_frames)[1]
    objs = clip.frames[frame % world.clip_frames].objects
    vehicles = [o for o in objs if o.cls in ("car", "bus", "truck")]
    moving = [o for o in objs if clip.directions[o.track_id] != "stationary"]
    biggest = max(moving, key=lambda o: ((o.box[2] - o.box[0]) * (o.box[3] - o.box[1]), -o.track_id), default=None)
    k = size / world.width
    return {"count": len(vehicles), "direction": clip.directions[biggest.track_id] if biggest else "stationary",
            "detect": sorted([[v * k for v in o.box] for o in vehicles], key=lambda b: b[:2])}


def test_scoring_counts_labels_and_boxes_against_truth():
    world = WorldConfig(seed=11, **WORLD)
    clip = render_clip(world, 0)[1]
    truth = FrameTruth(clip, 4)
    count, direction = TaskSpec("count"), TaskSpec("action")
    detect = TaskSpec("detect", classes=("car", "bus", "truck"))
    want = _expected(world, 4, 32)
    assert count.truth(truth, 32, 32) == want["count"] and direction.truth(truth, 32, 32) == want["direction"]
    assert [list(b) for b in detect.truth(truth, 32, 32)] == want["detect"]
    n = want["count"]
    assert count.score(from_text("count", f"There are {n} vehicles.", 32, 32), n) == {"correct": True, "abs_error": 0}
    assert count.score(from_text("count", f"{n + 2}", 32, 32), n) == {"correct": False, "abs_error": 2}
    assert direction.score(Prediction("label", label="left", parsed=True), "right")["correct"] is False
    boxes = [(0, 0, 10, 10), (20, 20, 30, 30)]
    hit = detect.score(Prediction("detect", boxes=[(1, 0, 10, 10), (50, 50, 60, 60)]), boxes)
    assert hit == {"tp": 1, "fp": 1, "fn": 1, "correct": False}
    metrics = StreamMetrics("s", ["count", "detect"], {"detect"})
    for score in ({"correct": True}, {"correct": False}, {"correct": True}):
        metrics.task_result("count", 10.0, 5.0, score, True, False, None)
    metrics.task_result("detect", 10.0, 5.0, hit, True, False, 5.0)
    metrics.task_result("detect", 30.0, 5.0, {"tp": 2, "fp": 0, "fn": 0}, True, False, 5.0)
    snap = metrics.snapshot()["tasks"]
    assert snap["count"]["accuracy"] == pytest.approx(2 / 3, abs=1e-4)
    assert snap["detect"]["accuracy"] == pytest.approx(2 * 3 / (2 * 3 + 1 + 1)), "F1 over all chunks' boxes"
    assert snap["detect"]["slo_violations"] == 2 and snap["detect"]["latency_ms"]["p50"] == 20.0


def test_accuracy_against_ground_truth_and_annotated_video(server, tmp_path):
    world = WorldConfig(seed=3, **WORLD)
    config = stream_from_dict({"name": "cam", "source": "synthetic:3", "n_clips": 2, "realtime": False,
                               "backpressure": "block", "chunk_frames": 5, "tasks": TASKS, "annotate":
                               str(tmp_path / "cam.mp4"), "draw_truth": True, **FAST})
    with JsonlSink(tmp_path / "out.jsonl") as sink, StreamManager(connector(server), sink=sink) as manager:
        manager.add(config)
        assert manager.wait(timeout=60)
        snap = manager.snapshot()["cam"]
    assert snap["status"] == "finished" and snap["chunks_processed"] == 4 and snap["chunks_dropped"] == 0
    records = [r for r in read_jsonl(tmp_path / "out.jsonl") if r["type"] == "result"]
    assert len(records) == 4 * 3 and all("error" not in r for r in records)
    for r in records:
        want = _expected(world, 5 * r["chunk"] + 2, 56)[r["task"]]  # the middle of frames 5k..5k+4
        if r["task"] == "detect":
            assert np.allclose(np.reshape(r["truth"], (-1, 4)), np.reshape(want, (-1, 4)))
        else:
            assert r["truth"] == want
        spec = TaskSpec(**TASKS[["count", "direction", "detect"].index(r["task"])])
        again = spec.score(from_text(spec.kind.answer, r["prediction"]["text"], 56, 56), r["truth"])
        assert again["correct"] == r["score"]["correct"], "the recorded score follows from the text"
    for task in ("count", "direction"):
        rows = [r for r in records if r["task"] == task]
        assert snap["tasks"][task]["accuracy"] == pytest.approx(np.mean([r["score"]["correct"] for r in rows]))
        assert snap["tasks"][task]["scored"] == 4
    d = [r["score"] for r in records if r["task"] == "detect"]
    tp, fp, fn = (sum(s[k] for s in d) for k in ("tp", "fp", "fn"))
    assert (snap["tasks"]["detect"]["tp"], snap["tasks"]["detect"]["fn"]) == (tp, fn)
    f1 = 1.0 if 2 * tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn)
    assert snap["tasks"]["detect"]["accuracy"] == pytest.approx(f1)
    for key in ("p50", "p95", "p99"):
        assert 0 < snap["latency_ms"][key] < 60000

    cap = cv2.VideoCapture(snap["annotated"])
    frames = []
    while (got := cap.read())[0]:
        frames.append(got[1])
    cap.release()
    assert len(frames) == 4 * 5 and frames[0].shape == (56, 56, 3)
    raw = cv2.resize(render_clip(world, 0)[0][0], (56, 56), interpolation=cv2.INTER_AREA)
    assert np.abs(frames[0][:8].astype(int) - raw[:8]).mean() > 20, "the banner is drawn over the top rows"
    assert np.abs(frames[0][-12:].astype(int) - raw[-12:]).mean() < 20, "the rest is the frame"


def _synthetic(name: str, seed: int, **extra) -> dict:
    return {"name": name, "source": f"synthetic:{seed}", "chunk_frames": 2, "tasks": [{"task": "count"}],
            **FAST, **extra}


def test_streams_are_added_and_removed_while_others_run(server):
    with StreamManager(connector(server)) as manager:
        a = manager.add(stream_from_dict(_synthetic("a", 1)))
        wait_for(lambda: a.metrics.chunks_processed >= 2, what="stream a")
        b = manager.add(stream_from_dict(_synthetic("b", 2)))
        with pytest.raises(ValueError, match="running already"):
            manager.add(stream_from_dict(_synthetic("b", 5)))
        wait_for(lambda: b.metrics.chunks_processed >= 2, what="stream b")
        final_a = manager.remove("a")
        assert a.done and final_a["status"] == "stopped" and manager.names == ["b"]
        seen_b = b.metrics.chunks_processed
        wait_for(lambda: b.metrics.chunks_processed >= seen_b + 2, what="b going on after a left")
        assert a.metrics.chunks_processed == final_a["chunks_processed"], "a stopped for good"
        again = manager.add(stream_from_dict(_synthetic("a", 3)))  # the name is free again
        wait_for(lambda: again.metrics.chunks_processed >= 1, what="a re-added")
        snaps = manager.snapshot()
        assert set(snaps) == {"a", "b"} and snaps["b"]["status"] == "running"
    assert b.done and again.done


def test_a_broken_source_reconnects_then_reports_while_the_others_go_on(server, tmp_path):
    frames, _ = render_clip(WorldConfig(seed=6, **WORLD), 0)
    (tmp_path / "www").mkdir()
    path = write_video(tmp_path / "www" / "cam.mp4", frames[:6], WORLD["fps"])
    reconnect = {"max_retries": 2, "backoff_s": 0.05, "backoff_max_s": 0.1}
    with http_server(path.parent) as web, JsonlSink(tmp_path / "out.jsonl") as sink, \
            StreamManager(connector(server), sink=sink) as manager:
        steady = manager.add(stream_from_dict(_synthetic("steady", 1)))
        url = f"http://127.0.0.1:{web.server_address[1]}/{path.name}"
        flaky = manager.add(stream_from_dict({**_synthetic("flaky", 0), "source": url, "reconnect": reconnect}))
        # the camera's stream ends every 6 frames: a break, and each time the stream reconnects
        wait_for(lambda: flaky.metrics.reconnects >= 2 and flaky.metrics.chunks_processed >= 4, what="reconnects")
        web.shutdown()
        web.server_close()  # the camera is gone for good: the retries fail and the stream gives up
        wait_for(lambda: flaky.done, what="the flaky stream to give up")
        seen = steady.metrics.chunks_processed
        wait_for(lambda: steady.metrics.chunks_processed >= seen + 2, what="the steady stream going on")
        snap = manager.snapshot()
    assert snap["flaky"]["status"] == "failed" and "gave up after 2 retries" in snap["flaky"]["last_error"]
    assert snap["steady"]["status"] == "running" and snap["steady"]["source_errors"] == 0
    events = [r["event"] for r in read_jsonl(tmp_path / "out.jsonl") if r["type"] == "event" and r["stream"] == "flaky"]
    assert {"reconnecting", "reconnected"} <= set(events) and events[-1] == "failed"


MANIFEST = {
    "adapters": [
        {"name": "fused_0", "path": "fused_0", "index": 0, "domains": ["count_vehicles", "detect_car"],
         "accuracies": {"count_vehicles": 0.8, "detect_car": 0.55}, "met": True},
        {"name": "fused_1", "path": "fused_1", "index": 1, "domains": ["count_people"],
         "accuracies": {"count_people": 0.95}, "met": True}],
    "tasks": {
        "count_vehicles": {"adapter": "fused_0", "head": "count_vehicles", "task": "count", "accuracy": 0.8,
                           "requirement": 0.6, "met": True},
        "detect_car": {"adapter": "fused_0", "head": "detect_car", "task": "detect", "accuracy": 0.55,
                       "requirement": 0.5, "met": True},
        "count_people": {"adapter": "fused_1", "head": "count_people", "task": "count", "accuracy": 0.95,
                         "requirement": 0.9, "met": True}},
    "order": ["count_vehicles", "detect_car", "count_people"], "created_by": "vlora fusion"}


def test_routes_come_from_the_manifest_and_fall_back_to_what_the_server_serves(server, tmp_path):
    from apps.video_analytics import load_manifest

    (tmp_path / "manifest.json").write_text(json.dumps(MANIFEST))
    manifest = load_manifest(str(tmp_path))
    served = ServerCaps(frozenset({"fused_0", "fused_1"}))
    cheapest = resolve_route("count", 0.6, manifest, served)
    assert (cheapest.adapter, cheapest.head, cheapest.output_mode) == ("fused_1", "count_people", "head")
    by_domain = resolve_route("count_vehicles", 0.6, manifest, served, heads="never")
    assert (by_domain.adapter, by_domain.output_mode) == ("fused_0", "generate")
    assert resolve_route("count", 0.99, manifest, served).adapter is None
    assert "knows no domain" in resolve_route("direction", 0.5, manifest, served).reason
    assert load_manifest(str(tmp_path / "none")) is None

    # the real server serves no adapters and cannot load any: every task lands on the base model
    with StreamManager(connector(server), manifest=manifest, load_adapters=True) as manager:
        config = _synthetic("routed", 1, tasks=[{"task": "count", "accuracy_target": 0.6}])
        runner = manager.add(stream_from_dict(config))
        route = runner.routes["count"]
        assert (route.selected, route.adapter, route.output_mode) == ("fused_1", None, "generate")
        assert "could not be loaded" in route.reason
        wait_for(lambda: runner.metrics.chunks_processed >= 1, what="a chunk on the base model")


def test_a_stream_task_is_routed_to_the_domain_asking_its_question(server, tmp_path):
    """With the questions recorded, the stream's count (of vehicles, by default) goes to the
    count_vehicles head, not to the cheaper and more accurate head that counts people."""
    from apps.video_analytics import load_manifest

    manifest = json.loads(json.dumps(MANIFEST))
    for domain, question in (("count_vehicles", "How many vehicles are there?"), ("detect_car", "Where are the cars?"),
                             ("count_people", "How many people are there?")):
        manifest["tasks"][domain]["question"] = question
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with StreamManager(connector(server), manifest=load_manifest(str(tmp_path))) as manager:
        config = stream_from_dict(_synthetic("asked", 1, tasks=[
            {"task": "count", "accuracy_target": 0.6},
            {"task": "count", "classes": ["person"], "name": "people", "accuracy_target": 0.6},
            {"task": "count", "classes": ["bus"], "name": "buses", "accuracy_target": 0.6}]))
        with connector(server)() as client:
            routes = manager.routes_for(config, client)
    assert routes["count"].selected == "fused_0" and "count_vehicles" in routes["count"].reason
    assert routes["people"].selected == "fused_1"
    assert routes["buses"].selected is None and "answers 'How many buses are there?'" in routes["buses"].reason


def test_a_refused_head_request_falls_back_to_generation(server, tmp_path):
    with JsonlSink(tmp_path / "out.jsonl") as sink, StreamManager(connector(server), sink=sink, heads="always") as m:
        runner = m.add(stream_from_dict(_synthetic("heads", 2, max_chunks=3)))
        assert runner.routes["count"].output_mode == "head"
        assert m.wait(timeout=60)
        snap = m.snapshot()["heads"]
    assert snap["routes"]["count"]["output_mode"] == "generate" and snap["tasks"]["count"]["mode_switches"] == 1
    assert snap["chunks_processed"] == 3 and snap["tasks"]["count"]["errors"] == 0
    switch = [r for r in read_jsonl(tmp_path / "out.jsonl") if r.get("event") == "mode_switch"]
    assert len(switch) == 1 and "head refused" in switch[0]["route"]["reason"]


def test_video_analytics_command_reports_every_stream_and_task(tiny_zoo, tmp_path, capsys):
    from vlora.commands import video_analytics
    from vlora.config import compose

    cfg = compose("video_analytics", [f"model.path={tiny_zoo[MODEL]}", "engine.device=cpu", "+engine.num_kv_blocks=512",
                                      "duration_s=3", "report_every_s=1", f"sink={tmp_path}/r.jsonl",
                                      f"report={tmp_path}/report.json", f"rpc.token={TOKEN}"])
    cfg.streams = OmegaConf.create([_synthetic("c0", 0, chunk_seconds=0.4, sample_fps=5, chunk_frames=None),
                                    _synthetic("c1", 1, tasks=TASKS[1:], annotate=str(tmp_path / "c1.mp4"))])
    report = video_analytics.run(cfg)
    assert report["server"]["own"] and set(report["streams"]) == {"c0", "c1"}
    assert set(report["streams"]["c1"]["tasks"]) == {"direction", "detect"}
    for snap in report["streams"].values():
        assert snap["chunks_processed"] >= 1 and snap["latency_ms"]["p95"] > 0
        assert all(0 <= t["accuracy"] <= 1 for t in snap["tasks"].values())
    assert json.loads((tmp_path / "report.json").read_text())["streams"]["c0"]["frames_in"] > 0
    out = capsys.readouterr()
    assert "c1" in out.out and "accuracy" in out.out and "c0" in out.err


def _fused_adapter(tiny_zoo, tmp_path, media: dict | None = None):
    """A real PEFT adapter with a count and a yes/no head, and its manifest (`media`: domain -> what
    the domain was trained on, recorded in the manifest when given)."""
    import torch

    from heads import HeadConfig, build_head, save_head
    from bench.adapter_parts import write_peft_adapter
    from serve.models import read_model_args

    args = read_model_args(tiny_zoo[MODEL])[0]
    adapter = write_peft_adapter(tmp_path / "fused_0", args, 8, ("q_proj", "v_proj"), 7, torch.float32, "cpu")
    torch.manual_seed(0)
    for name, config in {"count_vehicles": dict(type="count", max_count=6),
                         "exists_bus": dict(type="binary")}.items():
        save_head(build_head(HeadConfig(hidden_size=args.hidden_size, **config)), adapter / "heads" / name)
    manifest = {
        "adapters": [{"name": "fused_0", "path": "fused_0", "index": 0, "domains": ["count_vehicles", "exists_bus"],
                      "accuracies": {"count_vehicles": 0.6, "exists_bus": 0.9}, "met": True}],
        "tasks": {"count_vehicles": {"adapter": "fused_0", "head": "count_vehicles", "task": "count", "accuracy": 0.6,
                                     "requirement": 0.5, "met": True},
                  "exists_bus": {"adapter": "fused_0", "head": "exists_bus", "task": "binary", "accuracy": 0.9,
                                 "requirement": 0.8, "met": True}},
        "order": ["count_vehicles", "exists_bus"], "created_by": "vlora fusion"}
    for domain, kind in (media or {}).items():
        manifest["tasks"][domain]["media"] = kind
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    from apps.video_analytics import load_manifest

    return load_manifest(str(tmp_path))


def test_a_fused_adapter_with_several_heads_answers_each_task_with_its_own_head(server, tiny_zoo, tmp_path):
    """A fused adapter holds one head per domain: the stream's head request names its task, so the
    server picks that head instead of refusing an ambiguous request (and the route never degrades)."""
    with StreamManager(connector(server), manifest=_fused_adapter(tiny_zoo, tmp_path), load_adapters=True) as m:
        runner = m.add(stream_from_dict(_synthetic("fused", 3, max_chunks=2,
                                                   tasks=[{"task": "count", "accuracy_target": 0.5}])))
        assert (runner.routes["count"].adapter, runner.routes["count"].output_mode) == ("fused_0", "head")
        assert m.wait(timeout=60)
        snap = m.snapshot()["fused"]
    assert snap["routes"]["count"]["output_mode"] == "head" and snap["tasks"]["count"]["mode_switches"] == 0
    assert snap["chunks_processed"] == 2 and snap["tasks"]["count"]["errors"] == 0


@pytest.mark.parametrize("media", ["image", "clip", None])
def test_a_head_trained_on_pictures_is_sent_the_chunks_middle_frame(server, tiny_zoo, tmp_path, media):
    """The manifest records what each domain was trained on: a picture domain's head gets the
    chunk's middle frame as a picture (the frame the chunk's truth describes); a clip domain's,
    or one whose manifest does not say, gets the whole chunk as video."""
    from serve.rpc import Client

    sent = []

    class Watched(Client):  # the real client, noting what each request carries
        def submit_image(self, prompt, images, **kw):
            sent.append(("image", np.asarray(images).shape))
            return super().submit_image(prompt, images, **kw)

        def submit_video(self, prompt, frames, **kw):
            sent.append(("video", np.asarray(frames).shape))
            return super().submit_video(prompt, frames, **kw)

    manifest = _fused_adapter(tiny_zoo, tmp_path, {"count_vehicles": media} if media else None)
    with StreamManager(lambda: Watched("127.0.0.1", server.port, TOKEN), manifest=manifest, load_adapters=True) as m:
        runner = m.add(stream_from_dict(_synthetic("pictures", 3, max_chunks=2,
                                                   tasks=[{"task": "count", "accuracy_target": 0.5}])))
        assert runner.routes["count"].media == media and runner.routes["count"].output_mode == "head"
        assert m.wait(timeout=60)
        snap = m.snapshot()["pictures"]
    assert snap["chunks_processed"] == 2 and snap["tasks"]["count"]["errors"] == 0
    assert snap["tasks"]["count"]["head_answers"] == 2 and snap["routes"]["count"]["media"] == media
    frames = FAST["height"], FAST["width"], 3
    if media == "image":
        assert sent == [("image", frames)] * 2
    else:
        assert [kind for kind, _ in sent] == ["video"] * 2 and all(shape[1:] == frames and shape[0] > 1
                                                                for _, shape in sent)
