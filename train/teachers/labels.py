"""Labelled data as a teacher (kind "labels"): answers read from the world's ground truth.

`truth_answer` is also the yardstick the other teachers are measured against, so every target
is defined here once: counts and boxes of the queried classes, the colour / class of the
largest object (largest box area; for clips, in the middle frame), and the direction of the
largest object that moves (by its middle-frame box; "stationary" when nothing moves).

Labelled data from elsewhere (an image folder per class, COCO, YOLO, a Hugging Face dataset)
comes as a `DataTruth`: its objects (class, pixel box) answer count / boxes / exists / class as
the world's do, and its image-level `label` answers class / color (and count or exists when the
label is a number or yes/no) for data labelled per image.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from world import ClipTruth, ObjectTruth

from .base import TARGETS, Answer, Detection, Query, Sample, Teacher, TeacherError


@dataclass(frozen=True)
class DataObject:
    """One labelled object of a data source (ObjectTruth's fields that answers read)."""
    cls: str
    box: tuple[float, float, float, float]  # pixels, x2/y2 exclusive
    track_id: int = 0
    color: str | None = None


@dataclass
class DataTruth:
    """The labels of one item of a labelled data source."""
    objects: list[DataObject] = field(default_factory=list)
    label: str | None = None  # image-level label (a class folder, a label column)


def _area(o: ObjectTruth) -> int:
    x1, y1, x2, y2 = o.box
    return (x2 - x1) * (y2 - y1)


def _selected(truth, classes) -> list[ObjectTruth]:
    return [o for o in truth.objects if not classes or o.cls in classes]


def largest_object(truth, classes=None) -> ObjectTruth | None:
    objs = _selected(truth, classes)
    return max(objs, key=lambda o: (_area(o), -o.track_id)) if objs else None


def moving_direction(truth: ClipTruth, classes=None) -> str:
    """Direction of the largest moving object of a clip, or "stationary"."""
    moving = [o for o in _selected(truth, classes) if truth.directions[o.track_id] != "stationary"]
    if not moving:
        return "stationary"
    top = max(moving, key=lambda o: (_area(o), -o.track_id))
    return truth.directions[top.track_id]


def truth_answer(truth, query: Query, qa: list[tuple[str, str]] = (), sample_id: str = "") -> Answer:
    """The exact answer to `query` from a world truth record (ImageTruth or ClipTruth)."""
    t, classes = query.target, query.classes
    if isinstance(truth, DataTruth) and truth.label is not None:
        if t in ("class", "color"):
            return Answer(label=truth.label)
        if t == "count" and truth.label.isdigit():
            return Answer(count=int(truth.label))
        if t == "exists" and truth.label in ("yes", "no"):
            return Answer(label=truth.label)
    if t == "count":
        return Answer(count=len(_selected(truth, classes)))
    if t == "exists":
        return Answer(label="yes" if _selected(truth, classes) else "no")
    if t == "boxes":
        return Answer(boxes=tuple(Detection(o.cls, 1.0, tuple(float(v) for v in o.box), o.color)
                                  for o in sorted(_selected(truth, classes), key=lambda o: o.box[:2])))
    if t in ("color", "class"):
        top = largest_object(truth, classes)
        return Answer(label="none" if top is None else top.color if t == "color" else top.cls)
    if t == "direction":
        if not isinstance(truth, ClipTruth):
            raise TeacherError("target 'direction' needs clips (media: clip); an image has no motion")
        return Answer(label=moving_direction(truth, classes))
    if t == "qa":
        if not qa:
            return Answer(question=None, label=None)
        question, answer = qa[zlib.crc32(sample_id.encode()) % len(qa)]  # one pair per item, stable
        return Answer(question=question, label=answer)
    raise TeacherError(f"unknown target {t!r}; valid targets: {list(TARGETS)}")


class LabelsTeacher(Teacher):
    """The world's ground truth (or any labelled data carried by `Sample.truth` / `Sample.qa`)."""

    kind = "labels"
    targets = frozenset(TARGETS)

    def __init__(self, name: str = "truth", detail: str = "exact ground truth of the synthetic world"):
        self.name, self.detail = name, detail

    def answer(self, sample: Sample, query: Query, detections=None) -> Answer:
        if sample.truth is None:
            raise TeacherError(f"labels teacher {self.name!r}: sample {sample.id} carries no truth record")
        return truth_answer(sample.truth, query, sample.qa, sample.id)
