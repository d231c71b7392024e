"""The small-model (teacher) interface: structured predictions and the `Teacher` base class.

A teacher takes RGB frames (numpy HxWx3 uint8) or clips (lists of such frames) and answers
with structured predictions. Which questions it can answer is its set of `targets`:

    count      number of objects of some classes          (frame -> int)
    boxes      boxes of objects of some classes           (frame -> [Detection])
    exists     is there an object of some classes         (frame -> bool)
    color      colour of the largest object               (frame -> Label)
    class      class of the largest object                (frame -> Label)
    direction  motion of the largest moving object        (clip  -> Label)
    qa         question/answer pairs                      (labelled data only)

Detectors implement `detect` and get count / boxes / exists (and class of the largest box) for
free; classifiers implement `classify` for the one target they were fitted on; motion models
implement `direction`. `answer(sample, query)` is what the distiller calls; labelled data (kind
"labels") overrides it to read the truth instead of looking at pixels. A user's own class or
callable need not subclass Teacher: `plugins.PluginTeacher` wraps it (kind "plugin").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

KINDS = ("yolo", "opencv", "sklearn", "torch", "labels", "plugin")  # plugin: a user's class (plugins.py)
TARGETS = ("count", "boxes", "exists", "color", "class", "direction", "qa")
CLIP_TARGETS = frozenset({"direction"})  # targets that need a whole clip; the rest look at one frame
DETECTOR_TARGETS = frozenset({"count", "boxes", "exists", "class"})  # what any detector answers


class TeacherError(ValueError):
    """A teacher was asked for something it cannot answer, or was configured wrongly."""


@dataclass(frozen=True)
class Detection:
    """One detected object: class name, confidence and pixel box (x1, y1, x2, y2), x2/y2 exclusive."""
    cls: str
    score: float
    box: tuple[float, float, float, float]
    color: str | None = None  # detectors that see colour (OpenCV colour segmentation) fill it

    @property
    def area(self) -> float:
        return max(0.0, self.box[2] - self.box[0]) * max(0.0, self.box[3] - self.box[1])


@dataclass(frozen=True)
class Label:
    """A class label with the teacher's confidence (1.0 when the teacher gives none)."""
    label: str
    score: float = 1.0


@dataclass(frozen=True)
class Query:
    """What the distiller asks about one sample: a target, its class filter and label set."""
    target: str
    classes: tuple[str, ...] | None = None  # None = every class the teacher knows
    labels: tuple[str, ...] | None = None   # classify targets: the allowed answers


@dataclass
class Sample:
    """One item to label: its frames (RGB) and, for labelled data, the truth and QA pairs.

    `frames` holds one frame for an image and every frame of a clip. `truth` is a world truth
    record (ImageTruth / ClipTruth) or None; `qa` a list of (question, answer) pairs."""
    id: str
    media: str  # "image" | "clip"
    frames: list[np.ndarray]
    truth: Any = None
    qa: list[tuple[str, str]] = field(default_factory=list)

    @property
    def frame(self) -> np.ndarray:
        """The frame single-frame targets look at: the image, or a clip's middle frame (the frame
        the world's clip truth counts in)."""
        return self.frames[len(self.frames) // 2]


@dataclass(frozen=True)
class Answer:
    """A teacher's answer to one query; exactly the fields of the query's target are set."""
    label: str | None = None            # color / class / direction / "yes" | "no" / qa answer
    count: int | None = None
    boxes: tuple[Detection, ...] | None = None
    question: str | None = None         # qa only: the question the answer belongs to
    score: float = 1.0


def check_frame(frame: np.ndarray, what: str = "frame") -> np.ndarray:
    if not isinstance(frame, np.ndarray) or frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
        desc = f"{frame.shape} {frame.dtype}" if isinstance(frame, np.ndarray) else type(frame).__name__
        raise TeacherError(f"{what} must be an RGB numpy array HxWx3 uint8, got {desc}")
    return frame


def largest(dets: Sequence[Detection]) -> Detection | None:
    return max(dets, key=lambda d: (d.area, d.score)) if dets else None


class Teacher:
    """Base class of every small model. Subclasses set `name`, `kind`, `targets`, `detail` and
    implement the frame-level methods they support (`detect`, `classify`, `direction`)."""

    name: str = "teacher"
    kind: str = "labels"
    targets: frozenset[str] = frozenset()
    detail: str = ""
    classes: tuple[str, ...] | None = None  # detectors: class names they output
    labels: tuple[str, ...] | None = None   # classifiers: label set they output
    is_detector: bool = False               # answers count/boxes/exists/class through `detect`

    # ------------------------------------------------------------------ frame-level methods
    def detect(self, frame: np.ndarray) -> list[Detection]:
        raise TeacherError(f"teacher {self.name!r} ({self.kind}) is not a detector; it answers {sorted(self.targets)}")

    def detect_batch(self, frames: Sequence[np.ndarray]) -> list[list[Detection]]:
        return [self.detect(f) for f in frames]

    def classify(self, frame: np.ndarray) -> Label:
        raise TeacherError(f"teacher {self.name!r} ({self.kind}) is not a classifier; it answers {sorted(self.targets)}")

    def direction(self, clip: Sequence[np.ndarray]) -> Label:
        raise TeacherError(f"teacher {self.name!r} ({self.kind}) gives no motion direction; "
                           f"it answers {sorted(self.targets)}")

    def count(self, frame: np.ndarray, classes: Sequence[str] | None = None) -> int:
        return len(self._filtered(self.detect(frame), classes))

    def exists(self, frame: np.ndarray, classes: Sequence[str] | None = None) -> bool:
        return self.count(frame, classes) > 0

    # ------------------------------------------------------------------ distiller entry point
    def check_query(self, query: Query) -> None:
        """Raises TeacherError naming what this teacher can answer when it cannot answer `query`."""
        if query.target not in TARGETS:
            raise TeacherError(f"unknown target {query.target!r}; valid targets: {list(TARGETS)}")
        if query.target not in self.targets:
            raise TeacherError(f"teacher {self.name!r} ({self.kind}) cannot answer target {query.target!r}; "
                               f"it answers {sorted(self.targets)}")
        if self.classes is not None and query.classes:
            unknown = [c for c in query.classes if c not in self.classes]
            if unknown:
                raise TeacherError(f"teacher {self.name!r} does not know classes {unknown}; "
                                   f"its classes: {list(self.classes)}")

    def answer(self, sample: Sample, query: Query, detections: list[Detection] | None = None) -> Answer:
        """The teacher's answer for one sample (call `check_query` first). `detections` may carry
        this detector's detections of `sample.frame`, computed in a batch beforehand."""
        t = query.target
        if t == "direction":
            lab = self.direction(sample.frames)
            return Answer(label=lab.label, score=lab.score)
        if self.is_detector:
            dets = self._filtered(detections if detections is not None else self.detect(sample.frame), query.classes)
            if t == "count":
                return Answer(count=len(dets))
            if t == "exists":
                return Answer(label="yes" if dets else "no")
            if t == "boxes":
                return Answer(boxes=tuple(sorted(dets, key=lambda d: -d.score)))
            top = largest(dets)  # color / class: an attribute of the largest object
            value = None if top is None else top.cls if t == "class" else top.color
            return Answer(label=value or "none", score=top.score if top is not None else 1.0)
        lab = self.classify(sample.frame)  # a classifier fitted for this target (or any one-label target)
        if t == "count":
            return Answer(count=int(lab.label), score=lab.score)
        if t == "exists" and lab.label not in ("yes", "no"):
            truthy = lab.label.strip().lower() in ("true", "1", "y")
            return Answer(label="yes" if truthy else "no", score=lab.score)
        return Answer(label=lab.label, score=lab.score)

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _filtered(dets: Sequence[Detection], classes: Sequence[str] | None) -> list[Detection]:
        return list(dets) if not classes else [d for d in dets if d.cls in classes]

    def describe(self) -> dict[str, str]:
        """The `teacher` record of domain.json."""
        return {"kind": self.kind, "name": self.name, "detail": self.detail}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, kind={self.kind!r}, targets={sorted(self.targets)})"
