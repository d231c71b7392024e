"""Shadow teacher settings and scoring: the user's own small model answers a sampled share of a
stream's chunks, and its answer is compared with the served one (live accuracy on any source,
ground truth or not).

    shadow: {teacher: opencv_color, share: 0.1, seed: 0}          # in a stream's config entry
    tasks: [{task: count, shadow: {teacher: "yolo:best.pt", share: 0.5}}, {task: direction, shadow: false}]

`teacher` is passed unchanged to train.teachers.build_teacher (a built-in name, `yolo:<file.pt>`,
...); a task's own `shadow` replaces the stream's for that task, `false` turns it off. The
teacher answers on the chunk's frames as the source gave them, before the stream's resize (which
is for the model's copy only), as distillation's teacher answered on the recording's own frames;
the app warns at start where the sizes differ from what distillation recorded (resolution.py). The
comparison uses the task's own scoring (tasks.TaskSpec.score) with the teacher's answer in place
of the ground truth: agreement is the share of equal counts / labels, or F1 of boxes for
detection. The worker that runs the teacher is in shadow_worker.py.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # tasks.py builds a task's own ShadowConfig with shadow_from_dict
    from .tasks import TaskSpec

# app task -> teacher target (train/teachers/base.py TARGETS)
TARGETS = {"count": "count", "detect": "boxes", "direction": "direction", "exists": "exists", "classify": "class",
           "color": "color"}
_KEYS = ("teacher", "share", "seed", "queue_size", "dir")


@dataclass(frozen=True)
class ShadowConfig:
    teacher: Any  # a teacher spec for build_teacher, passed through unchanged
    share: float = 0.1  # fraction of chunks the teacher answers (sampled with `seed`)
    seed: int = 0
    queue_size: int = 4  # chunks waiting for the teacher, at most; older ones are dropped when it lags
    dir: str | None = None  # where built-in teachers are cached; None: $VLORA_HOME/teachers (.vlora/teachers)

    def __post_init__(self) -> None:
        if self.teacher is None or self.teacher == "" or self.teacher == {}:
            raise ValueError("shadow.teacher must name a teacher (e.g. opencv_color, yolo:<file.pt>)")
        if isinstance(self.share, bool) or not 0.0 < float(self.share) <= 1.0:
            raise ValueError(f"shadow.share must be in (0, 1], got {self.share!r}")
        if isinstance(self.queue_size, bool) or not isinstance(self.queue_size, int) or self.queue_size < 1:
            raise ValueError(f"shadow.queue_size must be an int >= 1, got {self.queue_size!r}")

    @property
    def teacher_dir(self) -> str:
        if self.dir:
            return str(self.dir)
        return str(Path(os.environ.get("VLORA_HOME", ".vlora")) / "teachers")

    @property
    def name(self) -> str:
        """The teacher as reports show it."""
        if isinstance(self.teacher, dict):
            return str(self.teacher.get("_target_") or self.teacher.get("name") or self.teacher)
        return str(self.teacher)


def shadow_from_dict(value: Any, where: str) -> ShadowConfig | None | bool:
    """A ShadowConfig from a config entry; None when absent, False when turned off (`shadow: false`)."""
    if value is None or isinstance(value, ShadowConfig):
        return value
    if value is False:
        return False
    if isinstance(value, str):  # shorthand: just the teacher
        return ShadowConfig(value)
    if not isinstance(value, dict):
        raise ValueError(f"{where}: shadow must be a mapping {{teacher, share, seed}}, false or null, got {value!r}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown shadow key(s) {unknown}; valid keys: {list(_KEYS)}")
    if "teacher" not in value:
        raise ValueError(f"{where}: shadow needs a teacher, e.g. {{teacher: opencv_color, share: 0.1}}")
    return ShadowConfig(**value)


class Sampler:
    """Which chunks a shadow answers: a seeded coin per chunk, the same every run."""

    def __init__(self, config: ShadowConfig, stream: str):
        self.share = float(config.share)
        self.rng = random.Random(f"{config.seed}/{stream}")

    def take(self) -> bool:
        return self.share >= 1.0 or self.rng.random() < self.share


def teacher_query(spec: "TaskSpec"):
    """The teacher's Query for a task (train.teachers is imported here, never by the stream)."""
    from train.teachers import Query

    if spec.task not in TARGETS:
        raise ValueError(f"task {spec.task!r} has no teacher target; shadowed tasks: {sorted(TARGETS)}")
    return Query(TARGETS[spec.task], spec.target_classes, spec.kind.labels or None)


def reference(spec: "TaskSpec", answer, scale: tuple[float, float] = (1.0, 1.0)) -> Any:
    """A teacher's Answer in the form TaskSpec.truth gives, so TaskSpec.score compares with it.
    scale: (x, y) from the teacher's frames to the served ones: the teacher sees the source's
    size, the served boxes are in the stream's resized frames."""
    if spec.task == "count":
        return answer.count
    if spec.task == "detect":
        fx, fy = scale
        boxes = ((d.box[0] * fx, d.box[1] * fy, d.box[2] * fx, d.box[3] * fy) for d in answer.boxes or ())
        return sorted((tuple(float(v) for v in b) for b in boxes), key=lambda b: b[:2])
    return answer.label
