"""Teachers by name: the built-in defaults (trained and cached on first use) and user models by path.

    yolo_world        our YOLO trained on the synthetic world (train_world_yolo)      kind yolo
    yolo:<file.pt>    any ultralytics detection checkpoint                           kind yolo
    opencv_color      colour segmentation of red / blue objects                      kind opencv
    opencv_motion     optical-flow direction of the largest moving object (clips)    kind opencv
    sklearn_color     logistic regression: colour of the largest object              kind sklearn
    sklearn:<dir>     a saved sklearn teacher (model.joblib)                         kind sklearn
    torch_class       tiny CNN: class of the largest object                          kind torch
    torch:<dir>       a saved torch teacher (model.pt)                               kind torch
    truth             the world's ground truth                                       kind labels
"""
from __future__ import annotations

import dataclasses
import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .base import DETECTOR_TARGETS, Teacher, TeacherError
from .fit import ClassifierSpec, fit_sklearn_teacher, fit_torch_teacher, load_sklearn_teacher, load_torch_teacher
from .labels import LabelsTeacher
from .opencv import ColorBlobDetector, MotionDirection
from .yolo import YoloTeacher
from .yolo_world import YoloWorldSpec, train_world_yolo

BUILTIN = {"yolo_world": "yolo", "opencv_color": "opencv", "opencv_motion": "opencv",
           "sklearn_color": "sklearn", "torch_class": "torch", "truth": "labels"}
TRAINED = ("yolo_world", "sklearn_color", "torch_class")  # the ones `vlora teachers` fits and caches
BY_PATH = {"yolo": "a .pt file", "sklearn": "a directory with model.joblib", "torch": "a directory with model.pt"}


@dataclass
class TeacherSettings:
    """Where teachers are cached and how the built-in ones are made (conf/teachers/default.yaml)."""
    dir: str
    yolo_world: YoloWorldSpec = field(default_factory=YoloWorldSpec)
    yolo_conf: float = 0.2
    sklearn_color: ClassifierSpec = field(default_factory=lambda: ClassifierSpec(target="color", seed=1100))
    torch_class: ClassifierSpec = field(default_factory=lambda: ClassifierSpec(target="class", seed=1200))
    opencv_color: dict = field(default_factory=lambda: {"colors": ["red", "blue"]})
    opencv_motion: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TeacherSettings":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TeacherError(f"unknown teacher settings {unknown}; valid: {sorted(known)}")
        if "yolo_world" in d:
            d["yolo_world"] = _spec(YoloWorldSpec, d["yolo_world"], "yolo_world")
        for key in ("sklearn_color", "torch_class"):
            if key in d:
                d[key] = _spec(ClassifierSpec, d[key], key)
        return cls(**d)


def _spec(cls, values, what: str):
    if isinstance(values, cls):
        return values
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TeacherError(f"teacher settings {what}: unknown keys {unknown}; valid: {sorted(known)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**values)


def teacher_names() -> list[str]:
    return list(BUILTIN) + [f"{k}:<{v}>" for k, v in BY_PATH.items()]


def teacher_targets(name: str, settings: TeacherSettings) -> frozenset[str] | None:
    """What teacher `name` answers, known without building it (None for a teacher by path, whose
    file decides); raises TeacherError for an unknown name."""
    kind, _, path = name.partition(":")
    if path and kind in BY_PATH:
        return DETECTOR_TARGETS if kind == "yolo" else None
    static = {"yolo_world": DETECTOR_TARGETS, "opencv_color": ColorBlobDetector.targets,
              "opencv_motion": MotionDirection.targets, "truth": LabelsTeacher.targets,
              "sklearn_color": frozenset({settings.sklearn_color.target}),
              "torch_class": frozenset({settings.torch_class.target})}
    if name not in static:
        raise TeacherError(f"unknown teacher {name!r}; valid teachers: {teacher_names()}")
    return static[name]


def build_teacher(name: str, settings: TeacherSettings, log: TextIO | None = None) -> Teacher:
    """The teacher called `name`, training or fitting a built-in one into `settings.dir` if needed."""
    root, log = Path(settings.dir), log or sys.stderr
    kind, _, path = name.partition(":")
    if path:
        if kind not in BY_PATH:
            raise TeacherError(f"unknown teacher {name!r}: a teacher by path is one of {list(BY_PATH)} "
                               f"followed by ':' and {', '.join(BY_PATH.values())}")
        if kind == "yolo":
            return YoloTeacher(path, name=name, conf=settings.yolo_conf, config_dir=root / "ultralytics")
        loader = load_sklearn_teacher if kind == "sklearn" else load_torch_teacher
        return loader(path, name=name)
    if name == "yolo_world":
        weights = train_world_yolo(settings.yolo_world, root / name, root / "ultralytics", log)
        return YoloTeacher(weights, name=name, conf=settings.yolo_conf, imgsz=settings.yolo_world.imgsz)
    if name == "sklearn_color":
        return fit_sklearn_teacher(settings.sklearn_color, root / name, name, log)
    if name == "torch_class":
        return fit_torch_teacher(settings.torch_class, root / name, name, log)
    if name == "opencv_color":
        return ColorBlobDetector(name=name, **settings.opencv_color)
    if name == "opencv_motion":
        return MotionDirection(name=name, **settings.opencv_motion)
    if name == "truth":
        return LabelsTeacher(name)
    raise TeacherError(f"unknown teacher {name!r}; valid teachers: {teacher_names()}")


def teacher_fingerprint(teacher: Teacher) -> str:
    """Identifies what a teacher would answer: its description plus the bytes of its weights."""
    h = hashlib.sha256(repr(sorted(teacher.describe().items())).encode())
    for attr in ("weights",):
        path = getattr(teacher, attr, None)
        if path is not None and Path(path).is_file():
            h.update(Path(path).read_bytes())
    for attr in ("estimator", "module"):
        obj = getattr(teacher, attr, None)
        if obj is not None:
            h.update(_model_bytes(obj))
    return h.hexdigest()[:16]


def _model_bytes(obj) -> bytes:
    if hasattr(obj, "state_dict"):
        import torch

        return b"".join(t.detach().cpu().numpy().tobytes() for t in obj.state_dict().values()
                        if isinstance(t, torch.Tensor))
    import pickle

    return pickle.dumps(obj)
