"""Teachers: the small vision models whose knowledge V-LoRA distils into adapters.

A teacher takes RGB frames (numpy HxWx3 uint8) or clips (lists of frames) and gives structured
predictions: `detect(frame) -> [Detection(cls, score, box)]`, `classify(frame) -> Label`,
`count(frame, classes) -> int`, `exists(frame, classes) -> bool`, `direction(clip) -> Label`.
`answer(sample, Query(target, classes))` is the one call the distiller makes.

    teacher = YoloTeacher("best.pt")                       # any ultralytics detector (kind yolo)
    teacher = ColorBlobDetector(["red"]) / MotionDirection()          # OpenCV (kind opencv)
    teacher = SklearnTeacher(fitted, features=color_histogram, target="color")  # kind sklearn
    teacher = TorchTeacher(module, preprocess, labels, target="class")          # kind torch
    teacher = LabelsTeacher()                              # the world's ground truth (kind labels)
    teacher = build_teacher("yolo_world", TeacherSettings(dir=".vlora/teachers"))  # built-ins, cached
    teacher = build_teacher({"_target_": "mypkg.PeopleCounter", "threshold": 0.5}, settings)  # a plug-in
    teacher = build_teacher("people_counter", settings)   # an entry point of the group vlora.teachers
    teacher = build_teacher({"kind": "process", "python": "/opt/cv4/bin/python", "target": "people.Hog"}, settings)
                                                           # another interpreter's teacher (process.py)

A user's own class or callable becomes a teacher through the small protocol of `plugins`
(`count(frame) -> int`, `classify(frame) -> str`, `exists(frame) -> bool`, `detect(frame) ->
[(cls, score, box)]`, `direction(frames) -> str`, or a plain `f(frame) -> answer`).

Built-in teachers trained on the synthetic world (`train_world_yolo`, `fit_sklearn_teacher`,
`fit_torch_teacher`) cache their weights and held-out metrics in `<dir>/<name>/teacher.json`.
"""
from .base import (CLIP_TARGETS, KINDS, TARGETS, Answer, Detection, Label, Query, Sample, Teacher,
                   TeacherError)
from .classifiers import FEATURES, SklearnTeacher, TorchTeacher, color_histogram, frame_tensor
from .fit import (ClassifierSpec, fit_sklearn_teacher, fit_torch_teacher, load_sklearn_teacher,
                  load_torch_teacher, tiny_cnn)
from .labels import DataObject, DataTruth, LabelsTeacher, largest_object, moving_direction, truth_answer
from .opencv import ColorBlobDetector, MotionDirection
from .plugins import METHOD_TARGETS, PluginTeacher, load_object, protocol_targets, wrap_teacher
from .process import ProcessTeacher, ProcessTeacherError
from .registry import (BUILTIN, BY_PATH, ENTRY_POINTS, REGISTRY, TRAINED, TeacherSettings, build_teacher, register,
                       teacher_fingerprint, teacher_names, teacher_targets)
from .yolo import YoloTeacher, ultralytics_offline
from .yolo_world import YoloWorldSpec, train_world_yolo, write_yolo_dataset

__all__ = [
    "Teacher", "TeacherError", "Detection", "Label", "Answer", "Query", "Sample", "KINDS", "TARGETS",
    "CLIP_TARGETS",
    "YoloTeacher", "ultralytics_offline", "YoloWorldSpec", "train_world_yolo", "write_yolo_dataset",
    "ColorBlobDetector", "MotionDirection",
    "SklearnTeacher", "TorchTeacher", "FEATURES", "color_histogram", "frame_tensor",
    "ClassifierSpec", "fit_sklearn_teacher", "fit_torch_teacher", "load_sklearn_teacher", "load_torch_teacher",
    "tiny_cnn",
    "LabelsTeacher", "DataTruth", "DataObject", "truth_answer", "largest_object", "moving_direction",
    "PluginTeacher", "wrap_teacher", "load_object", "protocol_targets", "METHOD_TARGETS",
    "ProcessTeacher", "ProcessTeacherError",
    "TeacherSettings", "build_teacher", "teacher_fingerprint", "teacher_names", "teacher_targets", "BUILTIN",
    "BY_PATH", "REGISTRY", "ENTRY_POINTS", "register", "TRAINED",
]
