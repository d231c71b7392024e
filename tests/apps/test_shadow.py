"""The shadow teacher: a small model answers a sampled share of a stream's chunks on its own thread,
and its agreement with the served answers is reported per stream and task, on a source without
ground truth (a video file), without ever holding up the stream."""

from __future__ import annotations

import subprocess
import sys
import time

import cv2
import numpy as np
import pytest
from apps_server import MODEL, connector, serving

from apps.video_analytics import (JsonlSink, ShadowConfig, ShadowWorker, StreamManager, TaskSpec, format_line,
                                  stream_from_dict)
from apps.common.answers import Prediction
from apps.video_analytics.shadow import Sampler
from train.teachers import Detection, Teacher
from vlora.commands import video_analytics


def _video(path, frames: int = 20, fps: float = 10.0, size: int = 64) -> str:
    """A red and a blue block crossing a grey road, written at its own frame rate."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (size, size))
    for i in range(frames):
        img = np.full((size, size, 3), 128, np.uint8)
        cv2.rectangle(img, (4 + i, 20), (20 + i, 30), (0, 0, 230), -1)  # BGR red
        cv2.rectangle(img, (40 - i // 2, 44), (52 - i // 2, 52), (230, 0, 0), -1)  # BGR blue
        writer.write(img)
    writer.release()
    return str(path)


def test_a_shadow_teacher_reports_agreement_on_a_file_source(tiny_zoo, tmp_path, capsys):
    config = stream_from_dict({
        "name": "file", "source": _video(tmp_path / "road.mp4"), "realtime": False, "backpressure": "block",
        "chunk_frames": 5, "width": 56, "height": 56, "encoding": "raw",
        "shadow": {"teacher": "opencv_color", "share": 1.0, "seed": 0, "dir": str(tmp_path / "teachers")},
        "tasks": [{"task": "count", "max_tokens": 4}, {"task": "detect", "classes": ["car", "bus", "truck"],
                                                      "max_tokens": 12}, {"task": "direction", "max_tokens": 4}]})
    with serving(tiny_zoo[MODEL]) as server, JsonlSink(tmp_path / "out.jsonl") as sink, \
            StreamManager(connector(server), sink=sink) as manager:
        manager.add(config)
        assert manager.wait(timeout=60)
        snap = manager.snapshot()["file"]
    assert snap["status"] == "finished" and snap["chunks_processed"] == 4
    tasks = snap["tasks"]
    for name in ("count", "detect"):
        shadow = tasks[name]["shadow"]
        assert shadow["teacher"] == "opencv_color" and shadow["compared"] == 4, shadow
        assert 0.0 <= shadow["agreement"] <= 1.0
        assert tasks[name]["accuracy"] is None, "no ground truth on a file: accuracy stays unmeasured"
    # a colour detector gives no motion direction: said once, never compared
    assert tasks["direction"]["shadow"]["compared"] == 0
    assert "cannot answer target 'direction'" in tasks["direction"]["shadow"]["last_error"]
    assert snap["shadow"]["sampled"] == 4 and snap["shadow"]["dropped"] == 0
    line = format_line(snap)
    assert f"count={tasks['count']['shadow']['agreement']:.2f}/4" in line and "agree" in line
    video_analytics.print_report({"streams": {"file": snap}})
    out = capsys.readouterr().out
    row = next(r for r in out.splitlines() if r.startswith("file") and " count " in r).split()
    assert row[-2:] == [f"{tasks['count']['shadow']['agreement']:.3f}", "4"] and row[-3] == "-"
    assert "shadow teacher opencv_color" in out and "cannot answer target 'direction'" in out


class SlowDetector(Teacher):
    """A user's small model that takes far longer per chunk than the stream allows."""
    name, kind, is_detector = "slow", "opencv", True
    targets = frozenset({"count", "boxes", "exists", "class"})

    def detect(self, frame):
        time.sleep(0.2)
        return [Detection("car", 0.9, (0.0, 0.0, 8.0, 8.0))]


@pytest.mark.alone
def test_a_slow_shadow_never_holds_up_the_stream_and_drops_when_behind():
    count = TaskSpec("count")
    worker = ShadowWorker("cam", [(ShadowConfig("slow", share=1.0, queue_size=2), [count])],
                          build=lambda spec, directory: SlowDetector()).start()
    frames = [np.zeros((16, 16, 3), np.uint8)] * 3
    began = time.perf_counter()
    for i in range(10):
        assert worker.sample() == {"count"}
        worker.offer(i, frames, [(count, Prediction("count", count=1 if i % 2 else 0, parsed=True))])
    offered_in = time.perf_counter() - began
    assert offered_in < 0.1, f"offering 10 chunks took {offered_in:.3f} s: the stream waited on the teacher"
    worker.close()
    worker.join(timeout=10)
    snap = worker.snapshot()
    compared = snap["tasks"]["count"]["compared"]
    assert snap["sampled"] == 10 and snap["dropped"] >= 5 and compared + snap["dropped"] == 10
    assert snap["teacher_ms"]["p50"] >= 200


def test_the_share_of_chunks_is_sampled_with_the_seed():
    a, b = Sampler(ShadowConfig("x", share=0.3, seed=5), "cam"), Sampler(ShadowConfig("x", share=0.3, seed=5), "cam")
    seq = [a.take() for _ in range(400)]
    assert seq == [b.take() for _ in range(400)] and 0.2 < sum(seq) / 400 < 0.4
    other = Sampler(ShadowConfig("x", share=0.3, seed=6), "cam")
    assert [other.take() for _ in range(400)] != seq


def test_the_command_gives_shadows_its_teachers_dir_and_teachers_never_pull_the_engine_in():
    from omegaconf import open_dict

    from vlora.config import compose

    cfg = compose("video_analytics", ["teachers_dir=/tmp/teachers-here"])
    cfg.streams[0].shadow = {"teacher": "opencv_color", "share": 0.2}
    with open_dict(cfg):
        cfg.streams[0].tasks[1].shadow = {"teacher": "opencv_motion", "dir": "/own"}
    job = video_analytics.job_from_cfg(cfg)
    config = stream_from_dict(video_analytics._with_teachers_dir(job.streams[0], job.teachers_dir))
    assert config.shadow == ShadowConfig("opencv_color", share=0.2, dir="/tmp/teachers-here")
    assert config.tasks[1].shadow.dir == "/own" and config.tasks[0].shadow is None
    code = ("import sys, apps.video_analytics, train.teachers; "
            "print(sorted(m for m in sys.modules if m.startswith(('serve.engine', 'serve.models', 'fusion'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
