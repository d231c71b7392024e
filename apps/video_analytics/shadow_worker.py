"""One stream's shadow teachers: a thread of their own beside the stream's worker.

The worker hands over a chunk's frames at the source's own size with the served answers (`offer`,
which never waits: the queue is bounded and drops its oldest chunk when the teacher lags): the
teacher looks at what distillation's teacher looked at, not at the model's resized copies, whose
size can change its answers (a detector at a third of the size finds fewer people). This thread builds the
teachers (on first use, so a built-in teacher that trains itself costs the stream nothing),
answers, scores the teacher's answer against the served one and keeps agreement per task.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from apps.common.answers import Prediction, f1
from apps.common.stats import percentiles

from .backpressure import BoundedQueue, Closed
from .shadow import Sampler, ShadowConfig, reference, teacher_query
from .tasks import TaskSpec


@dataclass
class Agreement:
    teacher: str
    compared: int = 0
    agreed: int = 0
    tp: int = 0
    fp: int = 0
    fn: int = 0
    errors: int = 0
    last_error: str | None = None
    off: bool = False  # the teacher cannot answer this task

    def to_dict(self, detect: bool) -> dict[str, Any]:
        value = None if not self.compared else f1(self.tp, self.fp, self.fn) if detect else self.agreed / self.compared
        out = {"teacher": self.teacher, "compared": self.compared,
               "agreement": None if value is None else round(value, 4), "errors": self.errors}
        if self.last_error:
            out["last_error"] = self.last_error
        return out


@dataclass
class _Group:
    """Tasks that share one shadow setting: one teacher, one coin per chunk."""
    config: ShadowConfig
    sampler: Sampler
    specs: list[TaskSpec]
    teacher: Any = None
    failed: str | None = None


@dataclass
class _Job:
    index: int
    frames: list  # RGB uint8 [H, W, 3], the chunk's frames at the source's size (the teacher's view)
    size: tuple[int, int] | None = None  # (width, height) of the frames the server got; None: the same as `frames`
    served: list[tuple[TaskSpec, Prediction, _Group]] = field(default_factory=list)


class ShadowWorker:
    def __init__(self, stream: str, groups: list[tuple[ShadowConfig, list[TaskSpec]]], build=None):
        """groups: each shadow setting with the tasks it covers. build(spec, dir) -> Teacher
        (default: train.teachers.build_teacher with TeacherSettings(dir=...))."""
        self.stream, self._build = stream, build or _build_teacher
        self.groups = [_Group(cfg, Sampler(cfg, stream), specs) for cfg, specs in groups]
        self.group_of = {s.label: g for g in self.groups for s in g.specs}
        self.detect = {s.label for g in self.groups for s in g.specs if s.task == "detect"}
        self.queue: BoundedQueue[_Job] = BoundedQueue(max(g.config.queue_size for g in self.groups), "drop_oldest")
        self.lock = threading.Lock()
        self.tasks = {s.label: Agreement(g.config.name) for g in self.groups for s in g.specs}
        self.sampled = 0
        self.teacher_ms: deque = deque(maxlen=4096)
        self._thread = threading.Thread(target=self._loop, name=f"{stream}-shadow", daemon=True)

    def start(self) -> "ShadowWorker":
        self._thread.start()
        return self

    # ---- the stream's side: never waits ------------------------------------------------------------
    def sample(self) -> set[str]:
        """The tasks whose shadow answers this chunk (one coin per shadow setting)."""
        return {s.label for g in self.groups if not g.failed and g.sampler.take() for s in g.specs
                if not self.tasks[s.label].off}

    def offer(self, index: int, frames: list, served: list[tuple[TaskSpec, Prediction]],
              size: tuple[int, int] | None = None) -> None:
        """frames: RGB at the source's size; size: (width, height) the served answers' boxes refer to."""
        if not served:
            return
        job = _Job(index, frames, size, [(spec, pred, self.group_of[spec.label]) for spec, pred in served])
        try:
            self.queue.put(job)  # drop_oldest: never blocks
        except Closed:
            return
        with self.lock:
            self.sampled += 1

    def close(self, drain: bool = True) -> None:
        if not drain:
            self.queue.clear()
        self.queue.close()

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            tasks = {label: a.to_dict(label in self.detect) for label, a in self.tasks.items()}
            stats = self.queue.stats
            return {"teachers": sorted({g.config.name for g in self.groups}), "sampled": self.sampled,
                    "dropped": stats.dropped, "answered": stats.taken, "teacher_ms": percentiles(self.teacher_ms),
                    "failed": {g.config.name: g.failed for g in self.groups if g.failed} or None, "tasks": tasks}

    # ---- the shadow's own thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self.queue.get(timeout=0.2)
            if job is None:
                if self.queue.drained:
                    return
                continue
            began = time.perf_counter()
            for spec, pred, group in job.served:
                self._compare(job, spec, pred, group)
            with self.lock:
                self.teacher_ms.append((time.perf_counter() - began) * 1e3)

    def _teacher(self, group: _Group):
        if group.teacher is None and group.failed is None:
            try:
                group.teacher = self._build(group.config.teacher, group.config.teacher_dir)
            except Exception as e:  # a bad spec or a teacher that cannot be built: this shadow only
                group.failed = f"{type(e).__name__}: {e}"
                for spec in group.specs:
                    self._error(spec.label, f"teacher not built ({group.failed})", off=True)
        return group.teacher

    def _compare(self, job: _Job, spec: TaskSpec, pred: Prediction, group: _Group) -> None:
        from train.teachers import Sample, TeacherError

        teacher = self._teacher(group)
        if teacher is None or self.tasks[spec.label].off:
            return
        try:
            query = teacher_query(spec)
            teacher.check_query(query)
        except (TeacherError, ValueError) as e:  # it cannot answer this task: stop asking it
            self._error(spec.label, str(e), off=True)
            return
        try:
            answer = teacher.answer(Sample(f"{self.stream}/{job.index}", "clip", job.frames), query)
            h, w = job.frames[0].shape[:2]
            served_w, served_h = job.size or (w, h)
            score = spec.score(pred, reference(spec, answer, (served_w / w, served_h / h)))
        except Exception as e:  # one bad answer: counted, the next chunk is tried again
            self._error(spec.label, f"{type(e).__name__}: {e}")
            return
        with self.lock:
            a = self.tasks[spec.label]
            a.compared += 1
            a.agreed += bool(score.get("correct"))
            a.tp, a.fp, a.fn = a.tp + score.get("tp", 0), a.fp + score.get("fp", 0), a.fn + score.get("fn", 0)

    def _error(self, label: str, error: str, off: bool = False) -> None:
        with self.lock:
            a = self.tasks[label]
            a.errors += 1
            a.last_error = error
            a.off = a.off or off


def _build_teacher(spec: Any, directory: str):
    from train.teachers import TeacherSettings, build_teacher

    return build_teacher(spec, TeacherSettings(dir=directory))


def shadow_groups(stream_shadow: ShadowConfig | None, tasks: list[TaskSpec]) -> list[tuple[ShadowConfig, list]]:
    """Tasks grouped by the shadow setting that covers them (a task's own, else the stream's)."""
    groups: list[tuple[ShadowConfig, list]] = []
    if stream_shadow is not None:
        shared = [t for t in tasks if t.shadow is None]
        if shared:
            groups.append((stream_shadow, shared))
    groups += [(t.shadow, [t]) for t in tasks if isinstance(t.shadow, ShadowConfig)]
    return groups
