"""A teacher run by another Python interpreter: OpenCV 4 or an old framework teaches without
entering this project's environment.

    teacher:
      kind: process
      python: /opt/cv4/bin/python     # the interpreter that has the teacher's dependencies
      target: people.HogPeople        # module.Class (or module:function) as that interpreter imports it
      args: {win_stride: 8}           # its keyword arguments
      path: [my_teachers]             # folders put on that interpreter's PYTHONPATH
      name: hog_people                # optional; default: the target's `name`, else the dotted path
      batch: 16                       # optional (conf/teachers: process): frames per message,
      timeout_s: 60                   #   seconds a message may take, and the start (import + build)
      start_timeout_s: 120

The parent starts `<python> process_worker.py` (standard library + numpy only, see its docstring
for the frame protocol), says hello, and gets the teacher's methods, classes and labels back; the
methods follow the plug-in protocol (`plugins`), so the answers are what the same class gives in
this process. A worker that dies or does not answer in time raises `ProcessTeacherError` naming
the interpreter and the end of the worker's stderr. The cache key covers the interpreter's path
and version, the target and its arguments, and the source files of the user's modules the worker
loaded (`code_files`), hashed here.
"""
from __future__ import annotations

import json
import os
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .base import Detection, TeacherError, check_frame
from .plugins import PluginTeacher, _detection
from .process_pipe import WORKER, ProcessTeacherError, Worker
from .process_worker import PROTOCOL

KEYS = ("kind", "python", "target", "args", "path", "name", "batch", "timeout_s", "start_timeout_s")
DEFAULTS = {"batch": 16, "timeout_s": 60.0, "start_timeout_s": 120.0}


def check_spec(spec: Mapping, defaults: Mapping | None = None) -> dict:
    """The process teacher's spec, checked without starting anything (errors name the key)."""
    spec = dict(spec)
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise TeacherError(f"process teacher: unknown keys {unknown}; valid: {list(KEYS)}")
    python = spec.get("python")
    if not isinstance(python, str) or not python:
        raise TeacherError(f"process teacher: python must name an interpreter (a path), got {python!r}")
    # not resolved: a venv's python is a link to the base interpreter, and the venv is what matters
    found = Path(os.path.expanduser(python))
    if not found.is_absolute() and os.sep not in python:
        import shutil

        found = Path(shutil.which(python) or python)
    if not (found.is_file() and os.access(found, os.X_OK)):
        raise TeacherError(f"process teacher: python {python!r} is not an executable file")
    target = spec.get("target")
    if not isinstance(target, str) or not all(p.isidentifier() for p in target.replace(":", ".").split(".")) \
            or "." not in target.replace(":", "."):
        raise TeacherError(f"process teacher: target must be a dotted path (module.Class), got {target!r}")
    args = spec.get("args") or {}
    if not isinstance(args, Mapping):
        raise TeacherError(f"process teacher: args must be a mapping of keyword arguments, got {args!r}")
    try:
        json.dumps(dict(args))
    except TypeError as e:
        raise TeacherError(f"process teacher: args must be plain values (they cross to the worker as JSON): {e}") from None
    path = spec.get("path") or []
    path = [path] if isinstance(path, str) else list(path)
    settings = {**DEFAULTS, **dict(defaults or {})}
    settings.update({k: spec[k] for k in DEFAULTS if spec.get(k) is not None})
    if not isinstance(settings["batch"], int) or settings["batch"] < 1:
        raise TeacherError(f"process teacher: batch must be an int >= 1, got {settings['batch']!r}")
    for k in ("timeout_s", "start_timeout_s"):
        if not isinstance(settings[k], (int, float)) or settings[k] <= 0:
            raise TeacherError(f"process teacher: {k} must be a positive number of seconds, got {settings[k]!r}")
    return {"python": os.path.abspath(found), "target": target, "args": dict(args),
            "path": [os.path.abspath(os.path.expanduser(str(p))) for p in path], "name": spec.get("name"), **settings}


def _close_worker(worker: Worker) -> None:
    worker.close()


class _Remote:
    """Stands for the teacher object in the worker: the plug-in protocol's methods it has."""

    def __init__(self, owner: "ProcessTeacher", ready: dict):
        self._owner = owner
        self.classes, self.labels = ready.get("classes"), ready.get("labels")


def _remote_class(methods: list[str]) -> type:
    def method(name):
        return lambda self, arg: self._owner.call(name, [arg])[0]

    return type("Remote", (_Remote,), {m: method(m) for m in methods})


class ProcessTeacher(PluginTeacher):
    """A teacher class run by another interpreter (see the module docstring); close() or the end
    of this process stops its worker."""

    kind = "process"

    def __init__(self, spec: Mapping, defaults: Mapping | None = None):
        s = check_spec(spec, defaults)
        self.python, self.target, self.args = s["python"], s["target"], s["args"]
        self.batch, self.timeout_s = s["batch"], float(s["timeout_s"])
        what = f"process teacher {s['name'] or self.target!r}"
        self.worker = Worker(self.python, s["path"], what)
        self._finalizer = weakref.finalize(self, _close_worker, self.worker)
        head, _ = self.worker.ask({"op": "hello", "protocol": PROTOCOL, "target": self.target, "args": self.args},
                                  (), float(s["start_timeout_s"]), f"its start (importing and building {self.target})")
        if head.get("op") != "ready":
            self.close()
            trace = "\n".join(f"  | {line}" for line in str(head.get("traceback", "")).strip().splitlines()[-8:])
            raise ProcessTeacherError(f"{what} in {self.python}: {self.target} could not be built there: "
                                      f"{head.get('error')}\n{trace}")
        self.ready = head
        self.modules: dict[str, str] = dict(head.get("modules") or {})
        remote = _remote_class(list(head.get("methods") or []))(self, head)
        name = s["name"] or head.get("name") or self.target
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(self.args.items()))
        super().__init__(remote, name, f"{self.target}({args}) in {self.python} (Python {head.get('python')})")
        # the cache key: where and what runs (not batch or timeouts, which change no answer)
        self.spec = {"kind": "process", "python": self.python, "target": self.target, "args": self.args}
        self.arguments = self.args  # the target's arguments: files among them are checkpoints to hash

    def call(self, method: str, items: Sequence[Any]) -> list:
        """The worker's answers of `method` to each item (a frame, or a clip: a list of frames), in
        messages of at most `batch` frames."""
        out, group, frames = [], [], 0
        for item in items:
            n = len(item) if isinstance(item, (list, tuple)) else 1
            if group and frames + n > self.batch:
                out += self._message(method, group)
                group, frames = [], 0
            group.append(item)
            frames += n
        if group:
            out += self._message(method, group)
        return out

    def _message(self, method: str, group: list) -> list:
        arrays, shape = [], []
        for item in group:
            clip = isinstance(item, (list, tuple))
            frames = list(item) if clip else [item]
            arrays += [check_frame(f, f"{self.name}: a frame") for f in frames]
            shape.append(len(frames) if clip else None)
        n = len(arrays)
        doing = f"a {method} message of {n} frame{'s' if n != 1 else ''}"
        head, _ = self.worker.ask({"op": "call", "method": method, "items": shape}, arrays, self.timeout_s, doing)
        if head.get("op") != "result":
            trace = "\n".join(f"  | {line}" for line in str(head.get("traceback", "")).strip().splitlines()[-8:])
            raise TeacherError(f"teacher {self.name!r} ({self.target} in {self.python}) failed on {doing}: "
                               f"{head.get('error')}\n{trace}")
        results = head.get("results")
        if not isinstance(results, list) or len(results) != len(group):
            raise ProcessTeacherError(f"teacher {self.name!r}: the worker answered {doing} with {results!r}")
        return results

    def detect_batch(self, frames: Sequence[np.ndarray]) -> list[list[Detection]]:
        if not self.is_detector:
            return super().detect_batch(frames)
        return [[_detection(d, f"{self.name}.detect") for d in (r or [])] for r in self.call("detect", list(frames))]

    def detect(self, frame: np.ndarray) -> list[Detection]:
        return self.detect_batch([frame])[0]

    def code_files(self) -> dict[str, Path]:
        """label -> file of the user's modules the worker loaded, as that interpreter found them."""
        out = {}
        for name, file in sorted(self.modules.items()):
            path = Path(file)
            label = name.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")
            if path.is_file():
                out[label] = path
        return out

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "ProcessTeacher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["ProcessTeacher", "ProcessTeacherError", "check_spec", "WORKER"]
