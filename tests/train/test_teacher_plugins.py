"""Teachers as plug-ins: the protocol wrapper, `_target_` mappings (ours loading a user's files
with the user's preprocessing), entry points, and fingerprints that follow a plug-in's spec."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from train.teachers import (BUILTIN, Query, Sample, TeacherError, TeacherSettings, build_teacher,
                            teacher_fingerprint, teacher_targets)

HERE = Path(__file__).resolve().parent


class BoxFinder:
    """A user's detector: one box per bright 8x8 tile."""

    classes = ("tile",)

    def detect(self, frame):
        out = []
        for y in range(0, frame.shape[0], 8):
            for x in range(0, frame.shape[1], 8):
                if frame[y:y + 8, x:x + 8].mean() > 128:
                    out.append(("tile", 0.9, (x, y, x + 8, y + 8)))
        return out


def mean_feature(frame):
    """A user's preprocessing for their scikit-learn model: the mean brightness."""
    return np.array([frame.mean() / 255.0], np.float32)


def scaled_mean(frame, scale=1.0):
    return frame.mean() * scale > 100


@pytest.fixture(autouse=True)
def _importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


def _frame(tiles: int) -> np.ndarray:
    img = np.zeros((16, 32, 3), np.uint8)
    for t in range(tiles):
        img[0:8, 8 * t:8 * t + 8] = 255
    return img


def test_detect_protocol_answers_every_detector_target(tmp_path):
    settings = TeacherSettings(dir=str(tmp_path))
    spec = {"_target_": "test_teacher_plugins.BoxFinder", "_name_": "tiles"}
    assert teacher_targets(spec, settings) == {"count", "boxes", "exists", "class"}
    teacher = build_teacher(spec, settings)
    sample = Sample("a", "image", [_frame(3)])
    assert teacher.name == "tiles" and teacher.classes == ("tile",)
    assert teacher.answer(sample, Query("count")).count == 3
    assert teacher.answer(sample, Query("exists", ("tile",))).label == "yes"
    assert [d.box for d in teacher.answer(sample, Query("boxes")).boxes][0] == (0.0, 0.0, 8.0, 8.0)
    with pytest.raises(TeacherError, match=r"does not know classes \['car'\]; its classes: \['tile'\]"):
        teacher.check_query(Query("count", ("car",)))


def test_partial_callable_and_entry_point(tmp_path, monkeypatch):
    settings = TeacherSettings(dir=str(tmp_path))
    spec = {"_target_": "test_teacher_plugins.scaled_mean", "_partial_": True, "scale": 0.1}
    teacher = build_teacher(spec, settings)
    assert teacher.answer(Sample("a", "image", [_frame(4)]), Query("exists")).label == "no", "scale 0.1 applies"

    import importlib.metadata

    class EP:
        name, value = "tile_finder", "test_teacher_plugins:BoxFinder"

        def load(self):
            return BoxFinder

    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda **kw: [EP()] if kw.get("group") == "vlora.teachers" else real(**kw))
    assert teacher_targets("tile_finder", settings) == {"count", "boxes", "exists", "class"}
    teacher = build_teacher("tile_finder", settings)
    assert teacher.answer(Sample("a", "image", [_frame(2)]), Query("count")).count == 2
    with pytest.raises(TeacherError, match=r"unknown teacher 'tile_findr'.*tile_finder"):
        build_teacher("tile_findr", settings)
    assert "labels" in BUILTIN and "truth" in BUILTIN


def test_user_sklearn_file_with_own_preprocessing_and_fingerprint(tmp_path):
    import joblib
    from sklearn.linear_model import LogisticRegression

    x = np.array([[0.1], [0.2], [0.8], [0.9]])
    model = tmp_path / "model.joblib"
    joblib.dump(LogisticRegression().fit(x, ["dark", "dark", "light", "light"]), model)
    spec = {"_target_": "train.teachers.SklearnTeacher", "path": str(model),
            "preprocess": "test_teacher_plugins.mean_feature", "name": "light"}
    settings = TeacherSettings(dir=str(tmp_path))
    assert teacher_targets(spec, settings) is None, "its file decides"
    teacher = build_teacher(spec, settings)
    assert teacher.kind == "sklearn" and set(teacher.labels) == {"dark", "light"}
    assert teacher.answer(Sample("a", "image", [_frame(4)]), Query("class")).label == "light"
    assert teacher.answer(Sample("b", "image", [_frame(0)]), Query("class")).label == "dark"
    before = teacher_fingerprint(teacher)
    assert teacher_fingerprint(build_teacher(spec, settings)) == before
    joblib.dump(LogisticRegression(C=0.01).fit(x, ["dark", "light", "light", "light"]), model)
    assert teacher_fingerprint(build_teacher(spec, settings)) != before, "the file's bytes count"
    with pytest.raises(TeacherError, match=r"preprocess 'test_teacher_plugins.nope'.*has no attribute 'nope'"):
        build_teacher({**spec, "preprocess": "test_teacher_plugins.nope"}, settings)


def test_user_torchscript_file(tmp_path):
    import torch

    net = torch.jit.script(torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 2)))
    net.save(str(tmp_path / "net.ts"))
    teacher = build_teacher({"_target_": "train.teachers.TorchTeacher", "path": str(tmp_path / "net.ts"),
                             "labels": ["a", "b"], "target": "class"}, TeacherSettings(dir=str(tmp_path)))
    assert teacher.targets == {"class"}
    assert teacher.answer(Sample("a", "image", [_frame(1)]), Query("class")).label in ("a", "b")


def test_plugin_errors_name_the_fix(tmp_path):
    settings = TeacherSettings(dir=str(tmp_path))
    with pytest.raises(TeacherError, match=r"needs _target_"):
        build_teacher({"threshold": 1}, settings)
    with pytest.raises(TeacherError, match=r"is a PosixPath, not a class or callable"):
        teacher_targets({"_target_": "test_teacher_plugins.HERE"}, settings)
    with pytest.raises(TeacherError, match=r"has none of the teacher methods"):
        teacher_targets({"_target_": "test_teacher_plugins.Sample"}, settings)
    with pytest.raises(TeacherError, match=r"BoxFinder' with arguments \['threshold'\] failed: TypeError"):
        build_teacher({"_target_": "test_teacher_plugins.BoxFinder", "threshold": 1}, settings)
