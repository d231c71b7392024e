"""The shadow teacher sees what distillation's teacher saw: the source's frames, not the stream's
resized copies (those go to the model only); the app warns at start when a stream's frame size
differs from the size its task's domain was distilled at; and the app cuts a recording into the
same whole chunks as distillation (a trailing partial chunk left out on both sides).

The teacher here counts bright blobs: 4x4-pixel dots that a 4x shrink averages into grey pixels it
no longer counts, so its answer depends on the resolution it is given (5 at 160x120, 0 at 40x30).
"""

from __future__ import annotations

import io
import json

import cv2
import numpy as np
import pytest
from apps_server import MODEL, TOKEN, serving

from apps.common.answers import Prediction
from apps.common.routing import Route
from apps.video_analytics import (Chunker, JsonlSink, ShadowConfig, ShadowWorker, StreamManager, TaskSpec,
                                  read_jsonl, stream_from_dict)
from apps.video_analytics.resolution import resolution_warnings
from apps.video_analytics.sources import CaptureSource
from serve.rpc import Client
from train.distill_sources import SourceSpec
from train.distill_video import VideoSource
from train.teachers import Detection, Teacher
from vlora.commands import video_analytics
from world.sampling import ChunkConfig, resize_frame

SOURCE, STREAM = (160, 120), (40, 30)
DOTS = [(10, 10), (50, 30), (90, 70), (130, 50), (30, 94)]  # top-left corners: 2 px off the 4x4 grid


def _video(path, frames: int, size=SOURCE) -> str:
    """Five white 4x4 dots on black, at 10 fps."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, size)
    for _ in range(frames):
        img = np.zeros((size[1], size[0], 3), np.uint8)
        for x, y in DOTS:
            img[y:y + 4, x:x + 4] = 255
        writer.write(img)
    writer.release()
    return str(path)


class BlobCounter(Teacher):
    """Counts bright blobs; records the size of every frame it was shown."""
    name, kind, is_detector = "blobs", "opencv", True
    targets = frozenset({"count", "boxes", "exists"})
    seen: list = []  # (width, height) of each frame looked at, across instances (the shadow builds its own)

    def detect(self, frame):
        BlobCounter.seen.append((frame.shape[1], frame.shape[0]))
        bright = (cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY) > 128).astype(np.uint8)
        n, _, stats, _ = cv2.connectedComponentsWithStats(bright)
        return [Detection("person", 1.0, (float(x), float(y), float(x + w), float(y + h)))
                for x, y, w, h, _ in stats[1:n]]


class FrameSizes(Client):
    """A real client that notes the size of the frames it sends the server."""
    sent: list = []

    def submit_video(self, prompt, frames, **kw):
        FrameSizes.sent += [(f.shape[1], f.shape[0]) for f in frames]
        return super().submit_video(prompt, frames, **kw)


@pytest.fixture(scope="module")
def server(tiny_zoo):
    with serving(tiny_zoo[MODEL]) as s:
        yield s


TEACHER = {"_target_": "test_shadow_resolution.BlobCounter"}
COUNT = {"task": "count", "classes": ["person"], "max_tokens": 2}


def test_the_teacher_counts_differently_at_the_streams_size(tmp_path):
    frame = next(iter(VideoSource(SourceSpec(kind="video", path=_video(tmp_path / "d.mp4", 2)), "t")._frames()))[2]
    assert len(BlobCounter().detect(frame)) == 5
    assert len(BlobCounter().detect(resize_frame(frame, *STREAM))) == 0


def test_the_shadow_teacher_gets_the_source_frames_and_the_model_the_resized_ones(server, tmp_path):
    BlobCounter.seen.clear()
    FrameSizes.sent.clear()
    config = stream_from_dict({
        "name": "door", "source": _video(tmp_path / "door.mp4", 21), "realtime": False, "backpressure": "block",
        "chunk_frames": 5, "width": STREAM[0], "height": STREAM[1], "encoding": "raw",
        "shadow": {"teacher": TEACHER, "share": 1.0}, "tasks": [COUNT]})
    with JsonlSink(tmp_path / "out.jsonl") as sink, \
            StreamManager(lambda: FrameSizes("127.0.0.1", server.port, TOKEN), sink=sink) as manager:
        manager.add(config)
        assert manager.wait(timeout=60)
        snap = manager.snapshot()["door"]
    assert snap["status"] == "finished"
    assert set(FrameSizes.sent) == {STREAM} and len(FrameSizes.sent) == 4 * 5, "the model's copies are resized"
    assert set(BlobCounter.seen) == {SOURCE}, f"the shadow teacher saw {set(BlobCounter.seen)}, not the source"
    assert snap["tasks"]["count"]["shadow"]["compared"] == 4
    # 21 frames in chunks of 5: the 21st frame is left out, as distillation leaves it out
    assert snap["chunks_made"] == 4 and snap["frames_in"] == 21
    events = [r for r in read_jsonl(tmp_path / "out.jsonl") if r.get("event") == "tail_left_out"]
    assert [(e["frames"], e["frames_per_chunk"]) for e in events] == [(1, 5)]


def test_served_boxes_are_compared_with_the_teachers_boxes_scaled_to_the_stream(tmp_path):
    frame = next(iter(VideoSource(SourceSpec(kind="video", path=_video(tmp_path / "d.mp4", 2)), "t")._frames()))[2]
    rgb = np.ascontiguousarray(frame[:, :, ::-1])
    detect = TaskSpec("detect", classes=("person",))
    worker = ShadowWorker("cam", [(ShadowConfig("blobs", share=1.0), [detect])],
                          build=lambda spec, directory: BlobCounter()).start()
    # the model found the five dots in its 40x30 frames: boxes a quarter of the source's
    served = [(x / 4, y / 4, (x + 4) / 4, (y + 4) / 4) for x, y in DOTS]
    worker.offer(0, [rgb] * 3, [(detect, Prediction("detect", boxes=served, parsed=True))], STREAM)
    worker.close()
    worker.join(timeout=10)
    assert worker.snapshot()["tasks"]["detect"]["agreement"] == 1.0


@pytest.mark.parametrize("frames,chunk_frames", [(21, 5), (23, 5), (20, 5), (9, 2)])
def test_the_app_and_distillation_cut_a_recording_into_the_same_whole_chunks(tmp_path, frames, chunk_frames):
    path = _video(tmp_path / "rec.mp4", frames)
    distilled = [[i for i, _, _ in c] for c in
                 VideoSource(SourceSpec(kind="video", path=path, chunk_frames=chunk_frames), "t")._chunks()]
    source = CaptureSource(path, live=False)
    source.open()
    chunker = Chunker("s", ChunkConfig(chunk_frames=chunk_frames), source.fps)
    app = [c.frame_indices for f in iter(source.read, None) if (c := chunker.push(f)) is not None]
    assert app == distilled and len(app) == frames // chunk_frames
    assert chunker.finish() == frames % chunk_frames and chunker.finish() == 0


def _domain(tmp_path, chunk_size, frame_size) -> str:
    """A manifest whose domain 'people' has an adapter folder recording its dataset, whose
    domain.json records the source as distillation writes it (VideoSource.record)."""
    recording = VideoSource(SourceSpec(kind="video", path=_video(tmp_path / f"rec{frame_size[0]}.mp4", 4, frame_size),
                                       width=chunk_size[0], height=chunk_size[1]), "t")
    dataset, adapter = tmp_path / "datasets" / "people", tmp_path / "adapters" / "people"
    dataset.mkdir(parents=True)
    adapter.mkdir(parents=True)
    (dataset / "domain.json").write_text(json.dumps({"name": "people", "task": "count", "source": recording.record()}))
    (adapter / "meta.json").write_text(json.dumps({"domains": {"people": {"task": "count", "dataset": str(dataset)}}}))
    manifest = {"adapters": [{"name": "people", "path": str(adapter), "index": 0, "domains": ["people"],
                              "accuracies": {"people": 0.8}, "met": True}],
                "tasks": {"people": {"adapter": "people", "head": "people", "task": "count", "accuracy": 0.8,
                                     "requirement": 0.0, "met": True, "question": "How many people are there?"}},
                "order": ["people"], "created_by": "vlora fusion"}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return str(tmp_path / "manifest.json")


def _job(manifest: str, stream: dict, tmp_path) -> video_analytics.VideoJob:
    return video_analytics.VideoJob("127.0.0.1", None, TOKEN, manifest, "auto", False, None, 1.0,
                                    str(tmp_path / "out.jsonl"), str(tmp_path / "report.json"), [stream])


@pytest.mark.parametrize("size,warned", [(STREAM, True), (SOURCE, False), (None, False)])
def test_a_stream_at_another_size_than_the_distillations_is_warned_in_one_line(server, tmp_path, size, warned):
    manifest = _domain(tmp_path, SOURCE, SOURCE)  # distilled at the recording's own 160x120
    stream = {"name": "door", "source": _video(tmp_path / "door.mp4", 5), "realtime": False, "chunk_frames": 5,
              "encoding": "raw", "tasks": [{**COUNT, "prompt": "How many people are there?", "accuracy_target": 0.5}]}
    if size is not None:
        stream.update(width=size[0], height=size[1])
    out = io.StringIO()
    report = video_analytics.run_streams(_job(manifest, stream, tmp_path), server.port, out)
    lines = [line for line in out.getvalue().splitlines() if "warning" in line]
    assert report["streams"]["door"]["routes"]["count"]["selected"] == "people"
    if warned:
        assert lines == ["video_analytics: warning: stream door, task count: the model gets 40x30 frames, domain "
                         "'people' was distilled from 160x120 chunks (set the stream's width/height to 160x120, "
                         "or distil at 40x30)"]
        assert report["streams"]["door"]["warnings"] == [lines[0].removeprefix("video_analytics: warning: ")]
    else:
        assert lines == [] and "warnings" not in report["streams"]["door"]


def test_a_shadow_on_a_source_unlike_the_distilled_recording_is_warned(tmp_path):
    from adapters.manifest import read_manifest

    manifest = read_manifest(_domain(tmp_path, STREAM, (320, 240)))  # recorded at 320x240, distilled to 40x30
    route = Route("count", None, None, "generate", selected="people")
    base = {"name": "door", "source": _video(tmp_path / "door.mp4", 5), "width": STREAM[0], "height": STREAM[1],
            "tasks": [{**COUNT, "prompt": "How many people are there?"}]}
    assert resolution_warnings(stream_from_dict(base), {"count": route}, manifest) == []
    shadowed = stream_from_dict({**base, "shadow": {"teacher": TEACHER}})
    assert resolution_warnings(shadowed, {"count": route}, manifest) == [
        "stream door, task count: its shadow teacher sees the source's 160x120 frames, distillation's teacher "
        "labelled 320x240 frames (agreement compares answers to different pictures)"]
    # a world domain records its world's size; no routed domain, nothing to compare
    (tmp_path / "datasets" / "people" / "domain.json").write_text(json.dumps({"world": {"config": {"width": 64,
                                                                                                  "height": 64}}}))
    assert "distilled from 64x64 chunks" in resolution_warnings(stream_from_dict(base), {"count": route}, manifest)[0]
    assert resolution_warnings(stream_from_dict(base), {"count": Route("count", None, None, "generate")}, manifest) == []
