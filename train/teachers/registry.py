"""One registry of teachers: built-ins, user models by path, plug-ins by `_target_` or entry point.

A teacher spec (a domain's `teacher`, or what the video app's shadow teacher names) is one of:

    "<name>"          a registered teacher: a built-in below, or an entry point of the group
                      `vlora.teachers` (a class, instantiated without arguments, or a callable)
    "<kind>:<path>"   a model file of one of our kinds (yolo / sklearn / torch)
    {_target_: mypkg.PeopleCounter, threshold: 0.5, _name_: people}
                      any class or callable, built by `hydra.utils.instantiate` with the other keys
                      as arguments (`_partial_: true` binds them to a callable teacher; a function
                      given without arguments is itself the teacher); `_name_` optionally names
                      it in the datasets (default: its `name` attribute, else the dotted path).
                      What it builds is wrapped by `plugins.PluginTeacher` unless it is a Teacher.
                      Our own classes load user files this way, with the user's preprocessing:
                      {_target_: train.teachers.SklearnTeacher, path: model.joblib, preprocess: mypkg.features}
    {kind: process, python: /opt/cv4/bin/python, target: people.HogPeople, args: {...}, path: [dir]}
                      a teacher class run by another interpreter behind a frame protocol (process.py)

Built-ins:

    yolo_world        our YOLO trained on the synthetic world (train_world_yolo)      kind yolo
    yolo:<file.pt>    any ultralytics detection checkpoint                           kind yolo
    opencv_color      colour segmentation of red / blue objects                      kind opencv
    opencv_motion     optical-flow direction of the largest moving object (clips)    kind opencv
    sklearn_color     logistic regression: colour of the largest object              kind sklearn
    sklearn:<dir>     a saved sklearn teacher (model.joblib)                         kind sklearn
    torch_class       tiny CNN: class of the largest object                          kind torch
    torch:<dir>       a saved torch teacher (model.pt)                               kind torch
    truth / labels    ground truth: the world's, or a labelled data source's         kind labels
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

from .base import DETECTOR_TARGETS, Teacher, TeacherError
from .fit import ClassifierSpec, fit_sklearn_teacher, fit_torch_teacher, load_sklearn_teacher, load_torch_teacher
from .labels import LabelsTeacher
from .opencv import ColorBlobDetector, MotionDirection
from .plugins import load_object, protocol_targets, wrap_teacher
from .process import ProcessTeacher, check_spec
from .provenance import FileHashes, teacher_provenance, update_with_model
from .yolo import YoloTeacher
from .yolo_world import YoloWorldSpec, train_world_yolo

ENTRY_POINTS = "vlora.teachers"
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
    process: dict = field(default_factory=dict)  # defaults of process teachers: batch, timeout_s, start_timeout_s

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


@dataclass(frozen=True)
class Registered:
    """A teacher known by name: its kind, what it answers (None: known once built) and a builder."""
    kind: str
    targets: Callable[["TeacherSettings"], frozenset[str] | None]
    build: Callable[[str, "TeacherSettings", TextIO], Teacher]


REGISTRY: dict[str, Registered] = {}


def register(name: str, kind: str, targets: Callable, build: Callable) -> None:
    if name in REGISTRY:
        raise TeacherError(f"teacher {name!r} is registered twice")
    REGISTRY[name] = Registered(kind, targets, build)


def _yolo_world(name, settings, log):
    root = Path(settings.dir)
    weights = train_world_yolo(settings.yolo_world, root / name, root / "ultralytics", log)
    # cached weights skip training, so the teacher must name the config dir too (without it a
    # second run imported ultralytics with its settings and fonts under ~/.config)
    return YoloTeacher(weights, name=name, conf=settings.yolo_conf, imgsz=settings.yolo_world.imgsz,
                       config_dir=root / "ultralytics")


register("yolo_world", "yolo", lambda s: DETECTOR_TARGETS, _yolo_world)
register("opencv_color", "opencv", lambda s: ColorBlobDetector.targets,
         lambda n, s, log: ColorBlobDetector(name=n, **s.opencv_color))
register("opencv_motion", "opencv", lambda s: MotionDirection.targets,
         lambda n, s, log: MotionDirection(name=n, **s.opencv_motion))
register("sklearn_color", "sklearn", lambda s: frozenset({s.sklearn_color.target}),
         lambda n, s, log: fit_sklearn_teacher(s.sklearn_color, Path(s.dir) / n, n, log))
register("torch_class", "torch", lambda s: frozenset({s.torch_class.target}),
         lambda n, s, log: fit_torch_teacher(s.torch_class, Path(s.dir) / n, n, log))
register("truth", "labels", lambda s: LabelsTeacher.targets, lambda n, s, log: LabelsTeacher(n))
register("labels", "labels", lambda s: LabelsTeacher.targets,
         lambda n, s, log: LabelsTeacher(n, detail="labels of the data source"))
BUILTIN = {name: r.kind for name, r in REGISTRY.items()}  # name -> kind of the built-in teachers


def _entry_point(name: str):
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINTS):
        if ep.name == name:
            try:
                return ep.load()
            except Exception as e:
                raise TeacherError(f"teacher {name!r}: entry point {ep.value!r} of group {ENTRY_POINTS!r} fails "
                                   f"to load ({type(e).__name__}: {e})") from None
    return None


def _entry_point_names() -> list[str]:
    from importlib.metadata import entry_points

    return sorted(ep.name for ep in entry_points(group=ENTRY_POINTS))


def teacher_names() -> list[str]:
    return (list(REGISTRY) + _entry_point_names() + [f"{k}:<{v}>" for k, v in BY_PATH.items()]
            + ["{_target_: dotted.path, ...}", "{kind: process, python: <interpreter>, target: module.Class, ...}"])


def _mapping(spec: Mapping) -> tuple[str, dict, str | None]:
    """(_target_, the other keys, _name_) of a mapping spec, checked."""
    if type(spec).__name__ == "DictConfig":  # a config node handed in as it is
        from omegaconf import OmegaConf

        spec = OmegaConf.to_container(spec, resolve=True)
    spec = dict(spec)
    target = spec.pop("_target_", None)
    if target is None:
        raise TeacherError(f"a teacher mapping needs _target_ (a dotted path to a class or callable), "
                           f"got keys {sorted(spec)}")
    name = spec.pop("_name_", None)
    if name is not None and (not isinstance(name, str) or not name):
        raise TeacherError(f"teacher _name_ must be a non-empty string, got {name!r}")
    return target, spec, name


def _is_bare_function(obj, args: dict) -> bool:
    """A function given without arguments is the teacher itself, not a factory to call."""
    return not inspect.isclass(obj) and callable(obj) and not {k for k in args if k != "_partial_"}


def _is_process(spec) -> bool:
    return isinstance(spec, Mapping) and spec.get("kind") == "process"


def teacher_targets(spec: str | Mapping, settings: TeacherSettings) -> frozenset[str] | None:
    """What teacher `spec` answers, known without building it (None when only the built teacher
    can tell: a model by path, a factory); raises TeacherError for an unknown name or a `_target_`
    that cannot be imported or has none of the teacher methods."""
    if _is_process(spec):  # another interpreter's teacher: its worker tells, once started
        check_spec(spec, settings.process)
        return None
    if isinstance(spec, Mapping):
        target, args, _ = _mapping(spec)
        obj = load_object(target)
        if isinstance(obj, type) and issubclass(obj, Teacher):
            return frozenset(obj.targets) or None
        if not callable(obj):
            raise TeacherError(f"teacher _target_ {target!r} is a {type(obj).__name__}, not a class or callable")
        if not inspect.isclass(obj) and not _is_bare_function(obj, args) and not args.get("_partial_"):
            return None  # a factory: what it returns decides
        found = protocol_targets(obj)
        if not found:
            raise TeacherError(f"teacher _target_ {target!r}: {getattr(obj, '__name__', obj)!r} has none of the "
                               f"teacher methods (detect, count, classify, exists, direction) and is not callable")
        return found
    if not isinstance(spec, str) or not spec:
        raise TeacherError(f"a teacher is a name, '<kind>:<path>' or a mapping with _target_, got {spec!r}")
    kind, _, path = spec.partition(":")
    if path and kind in BY_PATH:
        return DETECTOR_TARGETS if kind == "yolo" else None
    if spec in REGISTRY:
        return REGISTRY[spec].targets(settings)
    obj = None if path else _entry_point(spec)
    if obj is None:
        raise TeacherError(f"unknown teacher {spec!r}; valid teachers: {teacher_names()}")
    return protocol_targets(obj) or None


def build_teacher(spec: str | Mapping, settings: TeacherSettings, log: TextIO | None = None) -> Teacher:
    """The teacher `spec` names (see the module docstring), training or fitting a built-in one
    into `settings.dir` if needed. A plug-in carries its spec for `teacher_fingerprint`."""
    log = log or sys.stderr
    if _is_process(spec):
        teacher = ProcessTeacher(spec, settings.process)
        print(f"teacher {teacher.name}: {teacher.detail}", file=log, flush=True)
        return teacher
    if isinstance(spec, Mapping):
        return _build_plugin(spec, log)
    if not isinstance(spec, str) or not spec:
        raise TeacherError(f"a teacher is a name, '<kind>:<path>' or a mapping with _target_, got {spec!r}")
    kind, _, path = spec.partition(":")
    if path:
        if kind not in BY_PATH:
            raise TeacherError(f"unknown teacher {spec!r}: a teacher by path is one of {list(BY_PATH)} "
                               f"followed by ':' and {', '.join(BY_PATH.values())}")
        if kind == "yolo":
            return YoloTeacher(path, name=spec, conf=settings.yolo_conf,
                               config_dir=Path(settings.dir) / "ultralytics")
        loader = load_sklearn_teacher if kind == "sklearn" else load_torch_teacher
        return loader(path, name=spec)
    if spec in REGISTRY:
        return REGISTRY[spec].build(spec, settings, log)
    obj = _entry_point(spec)
    if obj is None:
        raise TeacherError(f"unknown teacher {spec!r}; valid teachers: {teacher_names()}")
    teacher = wrap_teacher(obj() if inspect.isclass(obj) else obj, spec, f"entry point {spec!r} of {ENTRY_POINTS}")
    teacher.spec = {"entry_point": spec, "object": f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"}
    return teacher


def _build_plugin(spec: Mapping, log: TextIO) -> Teacher:
    target, args, name = _mapping(spec)
    obj = load_object(target)
    if _is_bare_function(obj, args):
        built = obj
    else:
        from hydra.utils import instantiate

        try:
            built = instantiate({"_target_": target, **args}, _convert_="all")
        except Exception as e:
            cause = e.__cause__ or e
            raise TeacherError(f"teacher _target_ {target!r} with arguments {sorted(args)} failed: "
                               f"{type(cause).__name__}: {cause}") from None
    own = getattr(built, "name", None)
    name = name or (own if isinstance(own, str) and own and not isinstance(built, Teacher) else None) or target
    if isinstance(built, Teacher) and spec.get("_name_"):
        built.name = name
    teacher = wrap_teacher(built, name, f"{target}({', '.join(f'{k}={v!r}' for k, v in sorted(args.items()))})")
    teacher.spec = {"_target_": target, **args}
    print(f"teacher {teacher.name}: {teacher.detail}", file=log, flush=True)
    return teacher


def teacher_fingerprint(teacher: Teacher, hashes: FileHashes | None = None,
                        provenance: dict | None = None) -> str:
    """Identifies what a teacher would answer: its description, the spec it was built from (a
    plug-in's class path and arguments), the user's code behind it and the content of its weights
    and of any checkpoint its spec names (`teacher_provenance`, computed here unless given), and
    the parameters of a model it holds. A teacher with neither code nor files keeps the value it
    had before code was covered."""
    provenance = provenance if provenance is not None else teacher_provenance(teacher, hashes)
    h = hashlib.sha256(repr(sorted(teacher.describe().items())).encode())
    spec = getattr(teacher, "spec", None)
    if spec is not None:
        h.update(json.dumps(spec, sort_keys=True, default=str).encode())
    if provenance["code"]:
        h.update(json.dumps(provenance["code"], sort_keys=True).encode())
    for path, digest in sorted(provenance["checkpoints"].items()):
        h.update(f"{path}:{digest}".encode())
    update_with_model(h, teacher)
    return h.hexdigest()[:16]
