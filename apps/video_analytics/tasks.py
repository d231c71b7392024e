"""What a stream asks of each chunk: detection, counting, action (direction of motion),
classification (one label per chunk, e.g. which digit a camera shows, or what kind of object the
largest one is) and existence (yes / no: is there a bus?) - every task type a domain can have but
lm's free text, each answered by its domain's head.

A `TaskSpec` names the task, the objects it is about, its accuracy target (which picks the
adapter and head from the fusion manifest, see routing.py) and its latency target. This module
also turns a chunk's ground truth into the task's exact answer and scores a prediction against
it; the definitions match the distillation teachers' (train/teachers/labels.py): counts and
boxes of the queried classes in the middle frame, the direction of the largest moving object, for
classify the class of the largest object and for exists whether any queried object is there (the
world's truth; on other footage a task is scored by its shadow teacher only).

A classify task names its domain (`manifest_key: digits`) or asks the domain's question
(`prompt: Which digit is this?`): with a domain and no prompt it asks the question that domain's
items asked, which is what its head was trained on. Its labels are the domain's (meta.json), read
by routing, so generated text is parsed against them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from world import CLASS_SIZES, DIRECTIONS, ObjectTruth
from world.qa import plural

from apps.common.answers import Prediction, from_head, from_text, match_boxes
from .shadow import shadow_from_dict
from .sources import FrameTruth

if TYPE_CHECKING:
    from apps.common.routing import Route

VEHICLES = ("car", "bus", "truck")
CLASSIFY_QUESTION = "What kind of object is the largest one?"  # the world's classify domain (class_main) asks it


@dataclass(frozen=True)
class TaskKind:
    answer: str  # Prediction.kind
    classes: tuple[str, ...] | None  # default objects
    manifest_key: str  # domain or task type looked up in the fusion manifest
    max_tokens: int
    labels: tuple[str, ...] = ()


TASKS: dict[str, TaskKind] = {
    "detect": TaskKind("detect", ("car",), "detect", 48),
    "count": TaskKind("count", VEHICLES, "count", 8),
    "direction": TaskKind("label", None, "direction", 8, DIRECTIONS),
    # labels: the routed domain's (Route.labels); the world's classes when it records none
    "classify": TaskKind("label", None, "classify", 8, tuple(CLASS_SIZES)),
    "exists": TaskKind("yes_no", ("bus",), "binary", 4),  # a binary domain: "Is there a bus?"
}
ALIASES = {"detection": "detect", "counting": "count", "action": "direction", "classification": "classify",
           "binary": "exists"}


@dataclass(frozen=True)
class TaskSpec:
    task: str  # detect | count | direction | classify | exists (aliases: detection, counting, action, ...)
    accuracy_target: float = 0.0  # the cheapest manifest adapter reaching it serves the task
    latency_ms: float | None = None  # the task's latency target (sent as the request's SLO)
    classes: tuple[str, ...] | None = None  # objects the task is about; None: the task's default
    prompt: str | None = None  # None: a question built from the task and classes
    manifest_key: str | None = None  # None: the task's default domain / task type
    max_tokens: int | None = None
    box_scale: str = "auto"  # unit of boxes in generated text (answers.SCALES)
    name: str | None = None  # the name in reports; default: the task
    sampling: dict[str, Any] = field(default_factory=dict)  # further sampling fields for the server
    shadow: Any = None  # this task's own shadow teacher (shadow.ShadowConfig); False: none; None: the stream's

    def __post_init__(self) -> None:
        task = ALIASES.get(self.task, self.task)
        if task not in TASKS:
            raise ValueError(f"task must be one of {sorted(TASKS) + sorted(ALIASES)}, got {self.task!r}")
        object.__setattr__(self, "task", task)
        if isinstance(self.accuracy_target, bool) or not 0.0 <= float(self.accuracy_target) <= 1.0:
            raise ValueError(f"accuracy_target of task {task!r} must be in [0, 1], got {self.accuracy_target!r}")
        if self.latency_ms is not None and not float(self.latency_ms) > 0:
            raise ValueError(f"latency_ms of task {task!r} must be a positive number or null, got {self.latency_ms!r}")
        if self.classes is not None:
            object.__setattr__(self, "classes", tuple(self.classes))
        object.__setattr__(self, "sampling", dict(self.sampling or {}))
        object.__setattr__(self, "shadow", shadow_from_dict(self.shadow, f"task {self.label!r}"))

    @property
    def kind(self) -> TaskKind:
        return TASKS[self.task]

    @property
    def label(self) -> str:
        return self.name or self.task

    @property
    def key(self) -> str:
        return self.manifest_key or self.kind.manifest_key

    @property
    def target_classes(self) -> tuple[str, ...] | None:
        return self.classes if self.classes is not None else self.kind.classes

    def question(self) -> str:
        if self.prompt:
            return self.prompt
        classes = self.target_classes
        things = ("vehicles" if classes is not None and set(classes) == set(VEHICLES) else
                  "objects" if not classes else " and ".join(plural(c) for c in classes))
        if self.task == "count":
            return f"How many {things} are there?"
        if self.task == "detect":
            return f"Where are the {things}?"
        if self.task == "classify":
            return CLASSIFY_QUESTION
        if self.task == "exists":  # the world's binary domains ask "Is there a bus?"
            return f"Is there {_article(classes[0])}?" if classes and len(classes) == 1 else f"Are there any {things}?"
        return "Which way is the largest moving object going?"

    def asked(self, route: "Route | None" = None) -> str:
        """The question sent on `route`: the task's prompt; with a domain named (manifest_key) and no
        prompt, the question that domain's items asked (its head answers that one); else question()."""
        if not self.prompt and self.manifest_key and route is not None and route.question:
            return route.question
        return self.question()

    def sampling_params(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens or self.kind.max_tokens, **self.sampling}

    # ---- answers ----------------------------------------------------------------------------------
    def predict(self, final: dict[str, Any], width: int, height: int, labels: tuple[str, ...] = ()) -> Prediction:
        """A server's final event as this task's Prediction (head output when present, else text read
        against `labels`, the routed domain's, or the task's own when empty)."""
        if final.get("head") is not None:
            return from_head(self.kind.answer, final["head"], width, height)
        return from_text(self.kind.answer, final.get("text", ""), width, height, tuple(labels) or self.kind.labels,
                         self.box_scale)

    def truth(self, truth: FrameTruth, width: int, height: int) -> Any:
        """The exact answer for a chunk whose middle frame has `truth`, frames sent at width x height."""
        objects = _selected(truth.clip.frames[truth.frame].objects, self.target_classes)
        if self.task == "count":
            return len(objects)
        if self.task == "detect":
            sw, sh = truth.size
            fx, fy = width / sw, height / sh
            return [(o.box[0] * fx, o.box[1] * fy, o.box[2] * fx, o.box[3] * fy)
                    for o in sorted(objects, key=lambda o: o.box[:2])]
        if self.task == "classify":  # the class of the largest object, as the world's class teacher answers
            return max(objects, key=lambda o: (_area(o), -o.track_id)).cls if objects else None
        if self.task == "exists":
            return "yes" if objects else "no"
        moving = [o for o in objects if truth.clip.directions[o.track_id] != "stationary"]
        if not moving:
            return "stationary"
        return truth.clip.directions[max(moving, key=lambda o: (_area(o), -o.track_id)).track_id]

    def score(self, pred: Prediction, truth: Any, iou_threshold: float = 0.5) -> dict[str, Any]:
        """correct (bool) for counts and labels; tp / fp / fn for boxes (see answers.match_boxes)."""
        if self.task == "detect":
            tp, fp, fn = match_boxes(pred.boxes, truth, iou_threshold)
            return {"tp": tp, "fp": fp, "fn": fn, "correct": fp == 0 and fn == 0}
        value = pred.count if self.task == "count" else pred.label
        out: dict[str, Any] = {"correct": value is not None and value == truth}
        if self.task == "count" and value is not None:
            out["abs_error"] = abs(value - truth)
        return out


def _article(word: str) -> str:
    return f"an {word}" if word[:1] in "aeiou" else f"a {word}"


def _area(o: ObjectTruth) -> int:
    return (o.box[2] - o.box[0]) * (o.box[3] - o.box[1])


def _selected(objects: list[ObjectTruth], classes: tuple[str, ...] | None) -> list[ObjectTruth]:
    return [o for o in objects if not classes or o.cls in classes]


def task_from_dict(d: dict[str, Any]) -> TaskSpec:
    """A TaskSpec from a config entry; names the key that is not a TaskSpec field."""
    known = set(TaskSpec.__dataclass_fields__)
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"task entry {d!r}: unknown key(s) {unknown}; valid keys: {sorted(known)}")
    return TaskSpec(**d)
