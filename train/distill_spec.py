"""Knowledge-domain definitions: `DomainSpec` (one conf/dataset/<name>.yaml) and `DistillJob`.

A domain says what is asked (task + target + question), of which frames (source: the synthetic
world by default, with its seed and overrides, or a user's video, images or labelled data; media;
size) and who answers (teacher: a name, `<kind>:<path>`, or a mapping with `_target_`; see
train.teachers.registry). The target fixes the task:

    target     task       answers                          label set
    count      count      objects of `classes`              -
    boxes      detect     boxes of `classes`                -
    exists     binary     any object of `classes`           no, yes
    color      classify   colour of the largest object      the world's colours
    class      classify   class of the largest object       `classes` or the world's classes
    direction  classify   motion of the largest mover       left, right, up, down, stationary (clips)
    qa         lm         the world's question/answer pairs -

For a source other than the world, `classes` are checked against the teacher's (or the labelled
data's) declared classes instead of the world's, and label sets, max_count and max_boxes left
unset come from the teacher, the labels or the answers (see train.distill).

`augment: [hflip, vflip, reverse]` (any of them) adds mirrored / time-reversed copies of the
training items, labelled from the teacher's answers to the originals (train.distill_augment).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from world import DIRECTIONS, WorldConfig

from .distill_augment import check_augment
from .distill_sources import SourceError, SourceSpec
from .teachers import TARGETS, TeacherError

TASKS = ("classify", "count", "detect", "binary", "lm")
TASK_OF_TARGET = {"count": "count", "boxes": "detect", "exists": "binary", "color": "classify",
                  "class": "classify", "direction": "classify", "qa": "lm"}
MEDIA = ("image", "clip")
VERSION = 1


class DomainError(ValueError):
    """A domain definition that cannot be distilled; the message names the field and valid values."""


@dataclass
class DomainSpec:
    name: str
    task: str
    target: str
    teacher: str | dict                  # a name, "<kind>:<path>" or {_target_: ..., args}
    question: str | None = None          # the plain-language query; qa takes each pair's own
    classes: list[str] | None = None     # class filter of the target
    labels: list[str] | None = None      # classify: the label set (default: from the target)
    media: str | None = None             # image | clip; default: clip for a video source, else image
    size: int | None = None              # items labelled; default: 320 world items, or all of a source
    eval_fraction: float = 0.2
    frames_per_clip: int = 4             # clip frames the model sees, evenly spaced
    max_count: int | None = None         # count: largest count (default: the world's max_objects)
    max_boxes: int | None = None         # detect: most boxes kept (default: the world's max_objects)
    seed: int = 0                        # world seed of the frames
    world: dict = field(default_factory=dict)  # WorldConfig overrides, e.g. {min_objects: 1}
    source: dict = field(default_factory=dict)  # where frames come from (distill_sources); {} = the world
    augment: list = field(default_factory=list)  # mirrored / reversed training copies (distill_augment)

    def __post_init__(self) -> None:
        where = f"domain {self.name!r}"
        if not isinstance(self.name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_]*", self.name):
            raise DomainError(f"domain name must be lower-case letters, digits and _, got {self.name!r}")
        try:
            src = SourceSpec.from_dict(self.source, where)
        except (SourceError, TypeError) as e:
            raise DomainError(str(e)) from None
        self.source = {} if src.kind == "world" else src.to_dict()
        if self.media is None:
            self.media = src.media
        if src.kind != "world" and self.media != src.media:
            raise DomainError(f"{where}: a {src.kind} source gives media {src.media!r}, not {self.media!r}")
        if self.size is None and src.kind == "world":
            self.size = 320
        if self.task not in TASKS:
            raise DomainError(f"{where}: task {self.task!r} is not one of {list(TASKS)}")
        if self.target not in TARGETS:
            raise DomainError(f"{where}: target {self.target!r} is not one of {list(TARGETS)}")
        if TASK_OF_TARGET[self.target] != self.task:
            raise DomainError(f"{where}: task {self.task!r} does not match target {self.target!r}, "
                              f"which is a {TASK_OF_TARGET[self.target]!r} task")
        if self.media not in MEDIA:
            raise DomainError(f"{where}: media {self.media!r} is not one of {list(MEDIA)}")
        try:
            self.augment = check_augment(self.augment, self.target, self.media, where)
        except ValueError as e:
            raise DomainError(str(e)) from None
        if self.target == "direction" and self.media != "clip":
            raise DomainError(f"{where}: target 'direction' needs media: clip (an image has no motion)")
        if self.target != "qa" and not (isinstance(self.question, str) and self.question.strip()):
            raise DomainError(f"{where}: question is required (the plain-language query), got {self.question!r}")
        if self.size is not None and (isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 2):
            raise DomainError(f"{where}: size must be an int >= 2 (or null: all of a source), got {self.size!r}")
        if not 0.0 < float(self.eval_fraction) < 1.0:
            raise DomainError(f"{where}: eval_fraction must be in (0, 1), got {self.eval_fraction!r}")
        if not isinstance(self.frames_per_clip, int) or self.frames_per_clip < 1:
            raise DomainError(f"{where}: frames_per_clip must be an int >= 1, got {self.frames_per_clip!r}")
        if isinstance(self.teacher, Mapping):
            self.teacher = dict(self.teacher)
            if not isinstance(self.teacher.get("_target_"), str) and self.teacher.get("kind") != "process":
                raise DomainError(f"{where}: a teacher mapping needs _target_ (a dotted path to a class or callable), "
                                  f"got {self.teacher}")
        elif not isinstance(self.teacher, str) or not self.teacher:
            raise DomainError(f"{where}: teacher must name a teacher (a name, '<kind>:<path>' or a mapping with "
                              f"_target_), got {self.teacher!r}")
        try:
            cfg = self.world_config()
        except (TypeError, ValueError) as e:
            raise DomainError(f"{where}: bad world overrides {self.world}: {e}") from None
        if self.classes is not None:
            self.classes = [str(c) for c in self.classes]
            bad = [c for c in self.classes if c not in cfg.classes] if self.from_world else []
            if not self.classes or bad:
                raise DomainError(f"{where}: classes must be a non-empty list from the world's classes "
                                  f"{list(cfg.classes)}, got {self.classes}")
        if self.target == "exists" and not self.classes and self.from_world:
            raise DomainError(f"{where}: target 'exists' needs classes (which objects to ask about)")
        if self.labels is not None:
            self.labels = [str(v) for v in self.labels]
        self.labels = self.label_set(cfg)
        if self.augment and self.target == "direction" and not set(self.labels or ()) <= set(DIRECTIONS):
            raise DomainError(f"{where}: augment mirrors the directions {list(DIRECTIONS)}; labels {self.labels} "
                              "name others, whose mirror image is unknown")
        if self.task == "count" and self.max_count is None and self.from_world:
            self.max_count = cfg.max_objects
        if self.task == "detect" and self.max_boxes is None and self.from_world:
            self.max_boxes = cfg.max_objects
        for key in ("max_count", "max_boxes"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise DomainError(f"{where}: {key} must be an int >= 1, got {v!r}")

    @property
    def from_world(self) -> bool:
        return not self.source

    def source_spec(self) -> SourceSpec:
        return SourceSpec.from_dict(self.source, f"domain {self.name!r}")

    def world_config(self) -> WorldConfig:
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(self.world).items()}
        return WorldConfig.from_dict({**values, "seed": self.seed})

    def label_set(self, cfg: WorldConfig) -> list[str] | None:
        default = {"color": list(cfg.colors), "class": list(self.classes or cfg.classes),
                   "direction": list(DIRECTIONS)}
        if self.task == "binary":
            if self.labels not in (None, ["no", "yes"]):
                raise DomainError(f"domain {self.name!r}: a binary domain's labels are ['no', 'yes'], got {self.labels}")
            return ["no", "yes"]
        if self.task != "classify":
            if self.labels is not None:
                raise DomainError(f"domain {self.name!r}: labels apply to classify domains only, not {self.task!r}")
            return None
        labels = self.labels or (default[self.target] if self.from_world or self.target == "direction" else None)
        if labels is None:
            return None  # a source's domain: from the teacher, the labels or the answers (train.distill)
        if len(set(labels)) != len(labels) or len(labels) < 2:
            raise DomainError(f"domain {self.name!r}: labels must be >= 2 distinct names, got {labels}")
        return labels

    def to_dict(self) -> dict[str, Any]:
        """The spec's fields; `source` only when it is not the world and `augment` only when set (a
        domain's dict, and so its fingerprint, is what it was before either existed)."""
        d = dataclasses.asdict(self)
        if self.from_world:
            d.pop("source")
        if not self.augment:
            d.pop("augment")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DomainSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise DomainError(f"domain {d.get('name')!r}: unknown fields {unknown}; valid fields: {sorted(known)}")
        missing = [k for k in ("name", "task", "target", "teacher") if k not in d]
        if missing:
            raise DomainError(f"domain {d.get('name')!r}: missing fields {missing}")
        return cls(**d)


@dataclass
class DistillJob:
    """Where things go and which model's chat format the prompts use."""
    datasets_dir: str                    # <datasets_dir>/<domain>/ per the dataset contract
    world_dir: str                       # worlds the frames and clips are written to
    model: str = "qwen2_vl_tiny"         # zoo name (or any name) of the model
    model_path: str | None = None        # checkpoint dir; built from the zoo when missing
    zoo_seed: int = 0
    overwrite: bool = False              # redo finished domains even when their fingerprint matches
    progress: bool = True
    world_workers: int = 0               # processes rendering the world (0: this one); same world either way
    # threads calling the teacher on a chunk's items at once (1: one after another); the answers are
    # the same either way. A clip teacher's optical flow runs outside the GIL, so threads scale it.
    label_workers: int = 1

    def __post_init__(self) -> None:
        for name, least in (("world_workers", 0), ("label_workers", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise DomainError(f"distill.{name}={v!r}: must be an int >= {least}")


def fingerprint(*parts: Any) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def world_key(cfg: WorldConfig) -> str:
    """Directory name of a distillation world: the seed plus a hash of the rest of the config."""
    return f"distill-seed{cfg.seed}-{fingerprint(VERSION, cfg.to_dict())[:8]}"


__all__ = ["DomainSpec", "DistillJob", "DomainError", "TeacherError", "TASKS", "TASK_OF_TARGET", "MEDIA",
           "VERSION", "fingerprint", "world_key"]
