"""scikit-learn and torch classifiers as teachers.

Each wraps a fitted model with the feature function (sklearn) or preprocessing (torch) that turns
an RGB frame into its input, and names the one target it answers: "color" or "class" (of the
largest object), "exists" (classes yes/no; answers "yes"/"no") or "count" (answers an int).

    SklearnTeacher(estimator, features=color_histogram, target="color")   # any fitted estimator
    TorchTeacher(module, preprocess=to_tensor, labels=[...], target="class")

A user's own files load by path with the user's own preprocessing (also from a config mapping,
`{_target_: train.teachers.SklearnTeacher, path: model.joblib, preprocess: mypkg.features}`):

    SklearnTeacher(path="model.joblib", preprocess="mypkg.features")   # a joblib'd estimator / pipeline
    TorchTeacher(path="net.ts", preprocess="mypkg.to_tensor", labels=["cat", "dog"])  # TorchScript,
        # a whole module saved with torch.save, or a state_dict with module={_target_: mypkg.Net}

`preprocess` / `features` is a callable or a dotted path to one (frame -> model input). Without
`target` a classifier answers whichever one-label target the domain asks (its labels are the
domain's answers); with it, only that target.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import cv2
import numpy as np

from .base import Label, Teacher, TeacherError, check_frame
from .plugins import load_object

CLASSIFIER_TARGETS = ("color", "class", "exists", "count")


def color_histogram(frame: np.ndarray, bins: tuple[int, int, int] = (18, 4, 4)) -> np.ndarray:
    """Square-rooted, normalised HSV histogram [h*s*v] of the whole frame: the largest object's
    colour dominates the non-background part of it."""
    hsv = cv2.cvtColor(check_frame(frame), cv2.COLOR_RGB2HSV)
    hist = cv2.calcHist([hsv], [0, 1, 2], None, list(bins), [0, 180, 0, 256, 0, 256]).ravel()
    return np.sqrt(hist / max(float(hist.sum()), 1.0)).astype(np.float32)


# feature functions a saved sklearn teacher may name (a saved file stores the name, not code)
FEATURES: dict[str, Callable[[np.ndarray], np.ndarray]] = {"color_histogram": color_histogram}


def _check_target(target: str | None) -> str | None:
    if target is not None and target not in CLASSIFIER_TARGETS:
        raise TeacherError(f"a classifier teacher answers one of {list(CLASSIFIER_TARGETS)}, got target {target!r}")
    return target


def _as_text(value, target: str | None) -> str:
    """A model output as the answer text: yes/no for exists, an int string for count."""
    if target == "exists" or (target is None and isinstance(value, (bool, np.bool_))):
        if isinstance(value, str):
            return value
        return "yes" if bool(value) else "no"
    if target == "count":
        return str(int(value))
    return str(value)


class SklearnTeacher(Teacher):
    """Any fitted scikit-learn classifier (or pipeline) over `features(frame)`."""

    kind = "sklearn"

    def __init__(self, estimator=None, features: Callable[[np.ndarray], np.ndarray] | str | None = None,
                 target: str | None = None, name: str = "sklearn", detail: str | None = None,
                 path: str | None = None, preprocess: Callable[[np.ndarray], np.ndarray] | str | None = None):
        if path is not None:
            estimator, features, target, detail = _load_joblib(path, estimator, features, target, detail)
        features = preprocess if preprocess is not None else features
        if estimator is None or not hasattr(estimator, "predict") or not hasattr(estimator, "classes_"):
            raise TeacherError(f"SklearnTeacher needs a fitted classifier (with predict and classes_), "
                               f"got {type(estimator).__name__}" + (f" from {path}" if path else ""))
        if features is None:
            raise TeacherError("SklearnTeacher needs preprocess (features): a function frame -> feature vector, "
                               f"or a dotted path to one, or one of {sorted(FEATURES)}")
        if isinstance(features, str):
            features = FEATURES[features] if features in FEATURES else load_object(features, "preprocess")
        if not callable(features):
            raise TeacherError(f"SklearnTeacher preprocess must be callable, got {features!r}")
        self.estimator, self.features = estimator, features
        self.target = _check_target(target)
        self.targets = frozenset({self.target}) if self.target else frozenset(CLASSIFIER_TARGETS)
        self.name = name
        self.labels = tuple(_as_text(c, self.target) for c in estimator.classes_)
        self.detail = detail or (f"scikit-learn {type(estimator).__name__} on {getattr(features, '__name__', 'features')}, "
                                 f"{len(self.labels)} labels")

    def classify(self, frame: np.ndarray) -> Label:
        return self.classify_batch([frame])[0]

    def classify_batch(self, frames: Sequence[np.ndarray]) -> list[Label]:
        x = np.stack([self.features(f) for f in frames])  # [N, F]
        if hasattr(self.estimator, "predict_proba"):
            proba = self.estimator.predict_proba(x)       # [N, C], columns in classes_ order
            idx = proba.argmax(1)
            return [Label(self.labels[i], float(p[i])) for i, p in zip(idx, proba)]
        return [Label(_as_text(v, self.target)) for v in self.estimator.predict(x)]


def _load_joblib(path, estimator, features, target, detail):
    """A joblib file (or a directory with model.joblib): our saved dict, or a bare estimator."""
    import joblib

    file = Path(path) / "model.joblib" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise TeacherError(f"SklearnTeacher path {path}: no such file (a joblib file of a fitted estimator "
                           f"or pipeline, or a directory with model.joblib)")
    blob = joblib.load(file)
    if isinstance(blob, dict) and "estimator" in blob:
        return blob["estimator"], features or blob.get("features"), target or blob.get("target"), detail
    return blob, features, target, detail or f"scikit-learn {type(blob).__name__} ({file})"


def frame_tensor(frame: np.ndarray, size: int = 112):
    """RGB frame -> float tensor [3, size, size] in [0, 1] (area-averaged downscale)."""
    import torch

    small = cv2.resize(check_frame(frame), (size, size), interpolation=cv2.INTER_AREA)
    return torch.from_numpy(small).permute(2, 0, 1).float().div_(255.0)


class TorchTeacher(Teacher):
    """Any torch module mapping a batch [N, ...] from `preprocess(frame)` to logits [N, len(labels)]."""

    kind = "torch"

    def __init__(self, module=None, preprocess: Callable[[np.ndarray], "object"] | str | None = None,
                 labels: Sequence[str] | None = None, target: str | None = None, name: str = "torch",
                 detail: str | None = None, path: str | None = None):
        if path is not None:
            module = _load_module(path, module)
            detail = detail or f"torch {type(module).__name__} ({path})"
        if module is None:
            raise TeacherError("TorchTeacher needs a module (or path: a TorchScript file, a module saved with "
                               "torch.save, or a state_dict together with module)")
        if not labels:
            raise TeacherError("TorchTeacher needs the label of every output logit, got none")
        if preprocess is None:
            preprocess = frame_tensor
        elif isinstance(preprocess, str):
            preprocess = load_object(preprocess, "preprocess")
        self.module, self.preprocess = module.eval(), preprocess
        self.labels = tuple(str(v) for v in labels)
        self.target = _check_target(target)
        self.targets = frozenset({self.target}) if self.target else frozenset(CLASSIFIER_TARGETS)
        self.name = name
        self.detail = detail or f"torch {type(module).__name__}, {len(self.labels)} labels"

    def classify(self, frame: np.ndarray) -> Label:
        return self.classify_batch([frame])[0]

    def classify_batch(self, frames: Sequence[np.ndarray]) -> list[Label]:
        import torch

        with torch.inference_mode():
            logits = self.module(torch.stack([self.preprocess(f) for f in frames]))  # [N, C]
        if logits.ndim != 2 or logits.shape[1] != len(self.labels):
            raise TeacherError(f"torch teacher {self.name!r}: module gave logits {tuple(logits.shape)}, "
                               f"expected [N, {len(self.labels)}] (one per label)")
        proba = logits.float().softmax(1)
        score, idx = proba.max(1)
        return [Label(_as_text(self.labels[i], self.target), float(s)) for i, s in zip(idx.tolist(), score.tolist())]


def _load_module(path, module):
    import torch

    if not Path(path).is_file():
        raise TeacherError(f"TorchTeacher path {path}: no such file")
    try:
        return torch.jit.load(str(path), map_location="cpu")
    except (RuntimeError, ValueError):
        pass  # not TorchScript
    obj = torch.load(str(path), map_location="cpu", weights_only=module is not None)  # the user's own file
    if isinstance(obj, dict) and "state_dict" in obj:
        obj = obj["state_dict"]
    if isinstance(obj, dict):
        if module is None:
            raise TeacherError(f"TorchTeacher path {path} holds a state_dict; give module (e.g. "
                               f"module: {{_target_: mypkg.Net}}) to load it into")
        module.load_state_dict(obj)
        return module
    if not isinstance(obj, torch.nn.Module):
        raise TeacherError(f"TorchTeacher path {path} holds a {type(obj).__name__}, not a torch module")
    return obj
