"""Teachers: real ultralytics / OpenCV / scikit-learn / torch models against the world's truth."""

from __future__ import annotations

import json
import os
from pathlib import Path
import socket

import cv2
import numpy as np
import pytest
import torch

from train.teachers import (ClassifierSpec, ColorBlobDetector, LabelsTeacher, MotionDirection, Query, Sample,
                            SklearnTeacher, TeacherError, TeacherSettings, TorchTeacher, YoloTeacher,
                            YoloWorldSpec, build_teacher, color_histogram, fit_sklearn_teacher, fit_torch_teacher,
                            load_torch_teacher, train_world_yolo, truth_answer)
from world import WorldConfig, read_video, render_clip, render_image, write_video

CLASSES = ("car", "bus", "truck", "person", "bicycle")


def _rgb(bgr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(bgr[..., ::-1])


def _iou(a, b) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


@pytest.fixture
def no_network(monkeypatch):
    """Every attempt to open a connection or resolve a host is recorded and refused."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", lambda self, *a: refuse(*a))
    return attempts


def test_world_yolo_trains_offline_caches_and_detects(tmp_path, no_network, monkeypatch):
    spec = YoloWorldSpec(images=8, val_images=4, epochs=1, imgsz=96, batch=4)
    # relative paths, as with the default VLORA_HOME=.vlora: ultralytics must still write under them
    monkeypatch.chdir(tmp_path)
    weights = train_world_yolo(spec, Path("yolo_world"), Path("ultralytics"))
    assert no_network == [], "ultralytics tried to reach the network"
    data = tmp_path / "yolo_world" / "data"
    assert len(list((data / "images" / "train").glob("*.png"))) == 8
    first_label = (data / "labels" / "train" / "000000.txt").read_text().split()
    _, truth = render_image(WorldConfig(seed=spec.seed), 0)
    assert len(first_label) == 5 * len(truth.objects), "one line of 5 numbers per object"
    record = json.loads((tmp_path / "yolo_world" / "teacher.json").read_text())
    assert record["classes"] == list(CLASSES) and 0.0 <= record["val"]["map50"] <= 1.0

    stamp = weights.stat().st_mtime_ns
    assert train_world_yolo(spec, tmp_path / "yolo_world") == weights and weights.stat().st_mtime_ns == stamp

    teacher = YoloTeacher(weights, conf=0.001, imgsz=96)
    assert teacher.kind == "yolo" and teacher.classes == CLASSES and teacher.is_detector
    frame = _rgb(render_image(WorldConfig(seed=3), 0)[0])
    dets = teacher.detect(frame)
    assert all(d.cls in CLASSES and 0 <= d.score <= 1 and d.box[0] <= d.box[2] for d in dets)
    assert teacher.count(frame, ["car"]) == sum(d.cls == "car" for d in dets)
    assert no_network == []


def test_yolo_teacher_rejects_missing_weights(tmp_path):
    with pytest.raises(TeacherError, match="YOLO weights not found"):
        YoloTeacher(tmp_path / "nope.pt")


def test_color_detector_finds_world_objects_on_clean_renders():
    cfg = WorldConfig(seed=11, noise=0.0)
    detector = ColorBlobDetector(["red", "blue"])
    ious, classes_right, extra = [], [], 0
    for i in range(40):
        bgr, truth = render_image(cfg, i)
        dets = detector.detect(_rgb(bgr))
        wanted = [o for o in truth.objects if o.color in ("red", "blue")]
        matched = set()
        for o in wanted:
            score, j = max(((_iou(o.box, d.box), j) for j, d in enumerate(dets)), default=(0.0, None))
            ious.append(score)
            if j is not None and score >= 0.5:
                matched.add(j)
                classes_right.append(dets[j].cls == o.cls and dets[j].color == o.color)
        extra += len(dets) - len(matched)
    ious = np.array(ious)
    assert len(ious) >= 20
    assert (ious >= 0.5).mean() >= 0.9, f"only {(ious >= 0.5).mean():.2f} of red/blue objects found"
    assert np.mean(classes_right) >= 0.8 and extra <= 0.1 * len(ious)


def _moving_square(direction: str, n: int = 12) -> list[np.ndarray]:
    step = {"left": (-3, 0), "right": (3, 0), "up": (0, -3), "down": (0, 3), "stationary": (0, 0)}[direction]
    rng = np.random.default_rng(0)
    background = rng.integers(80, 110, (112, 112, 3), dtype=np.uint8)
    frames = []
    for t in range(n):
        f = background.copy()
        x, y = 40 + step[0] * t - (step[0] * n) // 2, 40 + step[1] * t - (step[1] * n) // 2
        f[y:y + 24, x:x + 30] = (220, 40, 40)
        f[y + 6:y + 12, x + 4:x + 12] = (240, 240, 240)  # texture, so flow has something to hold
        frames.append(f)
    return frames


@pytest.mark.parametrize("direction", ["left", "right", "up", "down", "stationary"])
def test_motion_direction_of_a_moving_square(direction):
    assert MotionDirection().direction(_moving_square(direction)).label == direction


def test_motion_direction_agrees_with_truth_on_video_files(tmp_path):
    cfg = WorldConfig(seed=5, clip_frames=16, fps=15)
    teacher, hits = MotionDirection(), []
    for i in range(16):
        frames, truth = render_clip(cfg, i)
        back = read_video(write_video(tmp_path / f"clip{i}.mp4", frames, cfg.fps))  # real, compressed video
        got = teacher.answer(Sample(f"clip-{i}", "clip", [_rgb(f) for f in back]), Query("direction"))
        hits.append(got.label == truth_answer(truth, Query("direction")).label)
    assert np.mean(hits) >= 0.7, f"direction agrees with the truth on {np.mean(hits):.2f} of clips"


def test_fitted_sklearn_and_torch_teachers_cache_and_reload(tmp_path):
    spec = ClassifierSpec(target="color", images=48, val_images=16)
    sk = fit_sklearn_teacher(spec, tmp_path / "sk")
    assert sk.kind == "sklearn" and set(sk.labels) <= set(WorldConfig().colors) and sk.targets == {"color"}
    stamp = (tmp_path / "sk" / "model.joblib").stat().st_mtime_ns
    again = fit_sklearn_teacher(spec, tmp_path / "sk")
    assert (tmp_path / "sk" / "model.joblib").stat().st_mtime_ns == stamp, "a second call loads the cache"
    frames = [_rgb(render_image(WorldConfig(seed=9, min_objects=1), i)[0]) for i in range(6)]
    assert [sk.classify(f) for f in frames] == [again.classify(f) for f in frames]

    tspec = ClassifierSpec(target="class", images=32, val_images=8, epochs=1)
    tt = fit_torch_teacher(tspec, tmp_path / "torch")
    assert tt.kind == "torch" and tt.labels == CLASSES
    reloaded = load_torch_teacher(tmp_path / "torch")
    with torch.no_grad():
        x = torch.stack([tt.preprocess(f) for f in frames])
        assert torch.equal(tt.module(x), reloaded.module(x))
    record = json.loads((tmp_path / "torch" / "teacher.json").read_text())
    assert 0.0 <= record["val_accuracy"] <= 1.0 and record["spec"]["target"] == "class"


def test_wrappers_take_any_fitted_estimator_or_module():
    from sklearn.tree import DecisionTreeClassifier

    cfg = WorldConfig(seed=2)
    frames, truths = zip(*[render_image(cfg, i) for i in range(30)])
    x = np.stack([color_histogram(_rgb(f)) for f in frames])
    y = [truth_answer(t, Query("exists", ("bus",))).label == "yes" for t in truths]
    tree = DecisionTreeClassifier(random_state=0).fit(x, y)
    teacher = SklearnTeacher(tree, color_histogram, target="exists", name="bus_tree")
    answers = [teacher.answer(Sample("i", "image", [_rgb(f)]), Query("exists", ("bus",))).label for f in frames]
    assert answers == ["yes" if v else "no" for v in y], "a fully grown tree fits its training set"

    linear = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 3))
    prep = lambda f: torch.from_numpy(cv2.resize(f, (8, 8))).permute(2, 0, 1).float() / 255  # noqa: E731
    tt = TorchTeacher(linear, prep, ["car", "bus", "truck"], target="class")
    assert tt.classify(_rgb(frames[0])).label in {"car", "bus", "truck"}
    bad = TorchTeacher(linear, prep, ["car", "bus"], target="class")
    with pytest.raises(TeacherError, match=r"expected \[N, 2\]"):
        bad.classify(_rgb(frames[0]))
    with pytest.raises(TeacherError, match="fitted classifier"):
        SklearnTeacher(DecisionTreeClassifier(), color_histogram, target="exists")


def test_labels_teacher_reads_truth_and_defines_the_targets():
    _, truth = render_image(WorldConfig(seed=4, min_objects=3), 1)
    teacher = LabelsTeacher()
    sample = Sample("image-1", "image", [np.zeros((4, 4, 3), np.uint8)], truth, [("q?", "a")])
    biggest = max(truth.objects, key=lambda o: (o.box[2] - o.box[0]) * (o.box[3] - o.box[1]))
    assert teacher.answer(sample, Query("color")).label == biggest.color
    assert teacher.answer(sample, Query("class")).label == biggest.cls
    assert teacher.answer(sample, Query("count", ("car",))).count == truth.counts["car"]
    assert teacher.answer(sample, Query("qa")).label == "a"
    with pytest.raises(TeacherError, match="needs clips"):
        teacher.answer(sample, Query("direction"))


def test_teacher_errors_name_what_is_valid(tmp_path):
    settings = TeacherSettings(dir=str(tmp_path))
    with pytest.raises(TeacherError, match=r"unknown teacher 'yolo_wrld'.*yolo_world"):
        build_teacher("yolo_wrld", settings)
    with pytest.raises(TeacherError, match="a teacher by path is one of"):
        build_teacher("onnx:/x.onnx", settings)
    motion = build_teacher("opencv_motion", settings)
    with pytest.raises(TeacherError, match=r"cannot answer target 'count'; it answers \['direction'\]"):
        motion.check_query(Query("count"))
    with pytest.raises(TeacherError, match="colors must be names from"):
        ColorBlobDetector(["grey"])
    with pytest.raises(TeacherError, match="HxWx3 uint8"):
        ColorBlobDetector().detect(np.zeros((8, 8), np.float32))
    assert not any(tmp_path.iterdir()), "nothing was trained for these"


_THREADS_SCRIPT = r"""
import os, sys
import cv2, numpy as np, torch

torch.set_num_threads(9)   # ultralytics would pick min(8, cores - 1): never 9
cv2.setNumThreads(3)       # its import sets 0
os.environ.pop("OMP_NUM_THREADS", None)  # its import sets 1 when unset
from train.teachers import YoloTeacher
from train.teachers.yolo_world import save_untrained_yolo

teacher = YoloTeacher(save_untrained_yolo(sys.argv[1] + "/u.pt", ("car", "bus")), imgsz=64)
teacher.detect_batch([np.zeros((48, 80, 3), np.uint8)] * 2)
print("kept", torch.get_num_threads(), cv2.getNumThreads(), os.environ.get("OMP_NUM_THREADS"))
from ultralytics.utils.torch_utils import select_device
select_device("cpu", verbose=False)  # the control: a bare ultralytics call does change torch's threads
print("bare", torch.get_num_threads())
"""


def test_a_yolo_teacher_leaves_the_process_thread_settings_as_it_found_them(tmp_path):
    # ultralytics set torch to 1 thread on 2 cores for everything after it in `vlora offline`
    # (pretraining, fusion) and OMP_NUM_THREADS=1 for every child process; a fresh interpreter
    # sees its import-time changes too.
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("kept", "bare")))
    assert lines["kept"] == "9 3 None", out.stdout
    assert lines["bare"] != "9", "the control: ultralytics changes torch's threads when not wrapped"
