"""A user's own model as a teacher: a class or callable wrapped into `Teacher`.

A domain's `teacher` may be a mapping `{_target_: mypkg.PeopleCounter, threshold: 0.5}`, built
with `hydra.utils.instantiate` (the other keys are its arguments), or a name registered under
the entry-point group `vlora.teachers`. What it gives back is used as it is when it is already a
`Teacher`; otherwise it is wrapped by `PluginTeacher`, which reads the protocol below. Frames
are RGB numpy arrays HxWx3 uint8; a clip is a list of them.

    detect(frame)    -> [(cls, score, (x1, y1, x2, y2)), ...]   answers count, boxes, exists, class
    count(frame)     -> int                                      answers count
    classify(frame)  -> str | (label, score)                     answers class, color
    exists(frame)    -> bool                                     answers exists
    direction(frames)-> str | (label, score)                     answers direction (clips)
    f(frame)         -> answer   (a plain callable, or an object with __call__): the answer's type
                                 is the domain's target (int for count, bool for exists, str for
                                 class/color; direction is given the clip's frames)

Optional attributes `classes` (class names a detector or counter outputs) and `labels` (what a
classifier answers) are checked against the domain's `classes` / `labels` before any work.
Detections may also be `Detection`s or dicts {cls, score, box}. Pixel boxes, x2/y2 exclusive.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Sequence

import numpy as np

from .base import CLIP_TARGETS, DETECTOR_TARGETS, TARGETS, Answer, Detection, Label, Query, Sample, Teacher, TeacherError

METHOD_TARGETS = {"detect": DETECTOR_TARGETS, "count": frozenset({"count"}),
                  "classify": frozenset({"class", "color"}), "exists": frozenset({"exists"}),
                  "direction": frozenset({"direction"})}
CALLABLE_TARGETS = frozenset(TARGETS) - {"qa"}  # a plain callable answers whatever the domain asks


def load_object(path: str, what: str = "_target_") -> Any:
    """The object a dotted path names: `pkg.module.attr` or `pkg.module:attr`."""
    if not isinstance(path, str) or not path.strip():
        raise TeacherError(f"{what} must be a dotted path to a class or function (mypkg.module.Name), got {path!r}")
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise TeacherError(f"{what} {path!r} is not a dotted path (mypkg.module.Name)")
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # a missing module, or one that fails while importing
        raise TeacherError(f"{what} {path!r}: cannot import module {module!r} ({type(e).__name__}: {e}); "
                           f"is its directory on PYTHONPATH (or the package installed)?") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(obj) if not n.startswith("_"))
            raise TeacherError(f"{what} {path!r}: {module!r} has no attribute {part!r}; it has {names[:20]}")
        obj = getattr(obj, part)
    return obj


def protocol_targets(obj: Any) -> frozenset[str]:
    """What a user's class, instance or callable answers, from the protocol methods it has."""
    if isinstance(obj, Teacher) or (inspect.isclass(obj) and issubclass(obj, Teacher)):
        return frozenset(obj.targets)
    found = frozenset().union(*[t for m, t in METHOD_TARGETS.items() if callable(getattr(obj, m, None))])
    if found:
        return found
    if inspect.isclass(obj) and callable(getattr(obj, "__call__", None)) and "__call__" in _own_attrs(obj):
        return CALLABLE_TARGETS
    if not inspect.isclass(obj) and callable(obj):
        return CALLABLE_TARGETS
    return frozenset()


def _own_attrs(cls) -> set[str]:
    return {n for k in inspect.getmro(cls) if k is not object for n in vars(k)}


def _label(value: Any, what: str) -> Label:
    if isinstance(value, Label):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return Label(str(value[0]), float(value[1]))
    if isinstance(value, (str, np.str_, int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return Label(str(value))  # a class index counts as its name
    raise TeacherError(f"{what} must return a label (str) or (label, score), got {value!r}")


def _detection(d: Any, what: str) -> Detection:
    if isinstance(d, Detection):
        return d
    if isinstance(d, dict):
        d = (d.get("cls", d.get("label")), d.get("score", 1.0), d.get("box"))
    try:
        cls, score, box = d
        x1, y1, x2, y2 = (float(v) for v in box)
        return Detection(str(cls), float(score), (x1, y1, x2, y2))
    except (TypeError, ValueError):
        raise TeacherError(f"{what} must return a list of (cls, score, (x1, y1, x2, y2)), got an item {d!r}") from None


def _as_yes_no(value: Any, what: str) -> str:
    if isinstance(value, str) and value in ("yes", "no"):
        return value
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        return "yes" if bool(value) else "no"
    raise TeacherError(f"{what} must return a bool (or 'yes' / 'no'), got {value!r}")


def _as_count(value: Any, what: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer, float, np.floating, str)):
        raise TeacherError(f"{what} must return an int, got {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise TeacherError(f"{what} must return an int, got {value!r}") from None
    if n < 0:
        raise TeacherError(f"{what} returned a negative count {n}")
    return n


class PluginTeacher(Teacher):
    """A user's object (or callable) following the protocol in this module's docstring."""

    kind = "plugin"

    def __init__(self, obj: Any, name: str, detail: str = ""):
        self.obj, self.name = obj, name
        self.targets = protocol_targets(obj)
        if not self.targets:
            raise TeacherError(f"teacher {name!r}: {type(obj).__name__} has none of the teacher methods "
                               f"{sorted(METHOD_TARGETS)} and is not callable; implement one of them")
        self.is_detector = callable(getattr(obj, "detect", None))
        classes, labels = getattr(obj, "classes", None), getattr(obj, "labels", None)
        self.classes = tuple(str(c) for c in classes) if classes else None
        self.labels = tuple(str(v) for v in labels) if labels else None
        self.detail = detail or f"{type(obj).__module__}.{type(obj).__qualname__}"

    def _method(self, target: str) -> Callable | None:
        for method, targets in METHOD_TARGETS.items():
            if target in targets and method != "detect" and callable(getattr(self.obj, method, None)):
                return getattr(self.obj, method)
        return None

    def detect(self, frame: np.ndarray) -> list[Detection]:
        if not self.is_detector:
            return super().detect(frame)
        out = self.obj.detect(frame)
        return [_detection(d, f"{self.name}.detect") for d in (out or [])]

    def classify(self, frame: np.ndarray) -> Label:
        fn = getattr(self.obj, "classify", None) or self.obj
        return _label(fn(frame), f"{self.name}.classify")

    def direction(self, clip: Sequence[np.ndarray]) -> Label:
        fn = getattr(self.obj, "direction", None) or self.obj
        return _label(fn(list(clip)), f"{self.name}.direction")

    def answer(self, sample: Sample, query: Query, detections: list[Detection] | None = None) -> Answer:
        t = query.target
        own = self._method(t)
        if own is None and self.is_detector and t in DETECTOR_TARGETS:
            return super().answer(sample, query, detections)
        fn = own or self.obj  # a plain callable answers in the domain's target's type
        what = f"teacher {self.name!r} ({getattr(fn, '__name__', type(fn).__name__)})"
        if t in CLIP_TARGETS:
            lab = self.direction(sample.frames) if own is None else _label(fn(list(sample.frames)), what)
            return Answer(label=lab.label, score=lab.score)
        value = fn(sample.frame)
        if t == "count":
            return Answer(count=_as_count(value, what))
        if t == "exists":
            return Answer(label=_as_yes_no(value, what))
        if t == "boxes":
            dets = [_detection(d, what) for d in (value or [])]
            return Answer(boxes=tuple(sorted(self._filtered(dets, query.classes), key=lambda d: -d.score)))
        lab = _label(value, what)
        return Answer(label=lab.label, score=lab.score)


def wrap_teacher(obj: Any, name: str, detail: str = "") -> Teacher:
    """`obj` as a Teacher: itself when it is one, else a PluginTeacher around it."""
    if isinstance(obj, Teacher):
        return obj
    return PluginTeacher(obj, name, detail)


__all__ = ["PluginTeacher", "wrap_teacher", "load_object", "protocol_targets", "METHOD_TARGETS",
           "CALLABLE_TARGETS"]
