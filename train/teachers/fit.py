"""Small classifiers fitted on the world's ground truth, cached on disk.

`fit_sklearn_teacher` fits a logistic regression on colour histograms (default: the colour of
the largest object); `fit_torch_teacher` trains `TinyCNN` (default: the class of the largest
object). Both render their own training images from a world seed of their own, measure accuracy
on held-out images, and keep model + `teacher.json` (spec fingerprint, accuracy) in `out_dir`:
a second call with the same spec loads instead of fitting.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from world import WorldConfig, render_image
from world.progress import ProgressLine

from .base import Query, TeacherError
from .classifiers import FEATURES, SklearnTeacher, TorchTeacher, frame_tensor
from .labels import truth_answer

RECORD = "teacher.json"


@dataclass(frozen=True)
class ClassifierSpec:
    """What a fitted classifier learns and from which world images."""
    target: str = "color"           # color | class | exists
    classes: tuple[str, ...] = ()   # class filter of the target (exists: the classes asked about)
    seed: int = 1100                # world seed of the training images
    images: int = 600
    val_images: int = 200
    world: dict = dataclasses.field(default_factory=lambda: {"min_objects": 1})
    features: str = "color_histogram"  # sklearn only: name in classifiers.FEATURES
    c: float = 10.0                 # sklearn only: inverse regularisation of the logistic regression
    epochs: int = 12                # torch only
    batch: int = 32
    lr: float = 3e-3
    size: int = 224                 # torch only: input side in px
    width: int = 16                 # torch only: channels of the stem
    stem: int = 4                   # torch only: patch size (and stride) of the stem

    def __post_init__(self) -> None:
        object.__setattr__(self, "classes", tuple(self.classes))
        if self.target not in ("color", "class", "exists"):
            raise TeacherError(f"a fitted classifier learns target color, class or exists, got {self.target!r}")
        if self.target == "exists" and not self.classes:
            raise TeacherError("target 'exists' needs the classes it asks about (classes: [bus])")

    def world_config(self, seed: int | None = None) -> WorldConfig:
        return WorldConfig.from_dict({**self.world, "seed": self.seed if seed is None else seed})

    def labels(self) -> tuple[str, ...]:
        cfg = self.world_config()
        if self.target == "color":
            return cfg.colors
        if self.target == "class":
            return self.classes or cfg.classes
        return ("no", "yes")

    def fingerprint(self, kind: str) -> str:
        blob = json.dumps({"kind": kind, "spec": dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def render_labelled(spec: ClassifierSpec, start: int, n: int, seed: int | None = None,
                    log: TextIO | None = None) -> tuple[list[np.ndarray], list[str]]:
    """RGB frames of world images start..start+n-1 and their target labels from the truth."""
    cfg, query = spec.world_config(seed), Query(spec.target, spec.classes or None)
    frames, labels, bar = [], [], ProgressLine(log)
    for i in range(start, start + n):
        bgr, truth = render_image(cfg, i)
        frames.append(np.ascontiguousarray(bgr[..., ::-1]))
        labels.append(truth_answer(truth, query).label)
        if log is not None and ((i - start + 1) % 100 == 0 or i == start + n - 1):
            bar.update(f"  rendered {i - start + 1}/{n}")
    if log is not None:
        bar.end()
    return frames, labels


def _cached(out_dir: Path, fingerprint: str, model_file: str) -> dict | None:
    rec_path = out_dir / RECORD
    if (out_dir / model_file).is_file() and rec_path.is_file():
        rec = json.loads(rec_path.read_text())
        if rec.get("fingerprint") == fingerprint:
            return rec
    return None


def _write_record(out_dir: Path, rec: dict) -> None:
    tmp = out_dir / (RECORD + ".tmp")
    tmp.write_text(json.dumps(rec, indent=2) + "\n")
    tmp.replace(out_dir / RECORD)


# ----------------------------------------------------------------------------- scikit-learn
def fit_sklearn_teacher(spec: ClassifierSpec, out_dir: str | Path, name: str = "sklearn_color",
                        log: TextIO | None = None) -> SklearnTeacher:
    import joblib
    from sklearn.linear_model import LogisticRegression

    out_dir, log = Path(out_dir), log or sys.stderr
    fp = spec.fingerprint("sklearn")
    if _cached(out_dir, fp, "model.joblib") is None:
        start = time.perf_counter()
        print(f"{name}: fitting a logistic regression on {spec.features} ({spec.target}) "
              f"over {spec.images} world images", file=log, flush=True)
        feats = FEATURES[spec.features]
        frames, y = render_labelled(spec, 0, spec.images + spec.val_images, log=log)
        x = np.stack([feats(f) for f in frames])  # [N, F]
        n = spec.images
        est = LogisticRegression(C=spec.c, max_iter=3000).fit(x[:n], y[:n])
        acc = float((est.predict(x[n:]) == np.array(y[n:])).mean())
        out_dir.mkdir(parents=True, exist_ok=True)
        joblib.dump({"estimator": est, "features": spec.features, "target": spec.target},
                    out_dir / "model.joblib")
        _write_record(out_dir, {"fingerprint": fp, "kind": "sklearn", "spec": dataclasses.asdict(spec),
                                "val_accuracy": round(acc, 4), "fit_seconds": round(time.perf_counter() - start, 1)})
        print(f"{name}: held-out accuracy {acc:.3f}", file=log, flush=True)
    return load_sklearn_teacher(out_dir, name)


def load_sklearn_teacher(out_dir: str | Path, name: str = "sklearn_color") -> SklearnTeacher:
    import joblib

    path = Path(out_dir) / "model.joblib"
    if not path.is_file():
        raise TeacherError(f"no sklearn teacher at {path}; fit one with `vlora teachers`")
    blob = joblib.load(path)
    return SklearnTeacher(blob["estimator"], blob["features"], blob["target"], name=name,
                          detail=f"scikit-learn {type(blob['estimator']).__name__} on {blob['features']} "
                                 f"({path})")


# ----------------------------------------------------------------------------- torch
def tiny_cnn(n_labels: int, width: int = 16, stem: int = 4):
    """A patchify stem (stem x stem conv, stride stem), three stride-2 conv blocks and a linear
    layer: [N, 3, S, S] -> logits [N, n_labels]. The stem keeps full-resolution detail at the cost
    of a 2x-downscaled input. Global max pooling keeps "is there a small object" (average pooling
    would dilute it)."""
    import torch.nn as nn

    def block(cin, cout, k=3, s=2, p=1):
        return nn.Sequential(nn.Conv2d(cin, cout, k, s, p, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    w = width
    return nn.Sequential(block(3, w, stem, stem, 0), block(w, 2 * w), block(2 * w, 4 * w), block(4 * w, 4 * w),
                         nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(4 * w, n_labels))


def fit_torch_teacher(spec: ClassifierSpec, out_dir: str | Path, name: str = "torch_class",
                      log: TextIO | None = None) -> TorchTeacher:
    import torch

    out_dir, log = Path(out_dir), log or sys.stderr
    fp = spec.fingerprint("torch")
    if _cached(out_dir, fp, "model.pt") is None:
        start = time.perf_counter()
        labels = spec.labels()
        print(f"{name}: training a tiny CNN ({spec.target}) on {spec.images} world images, "
              f"{spec.epochs} epochs", file=log, flush=True)
        frames, y = render_labelled(spec, 0, spec.images + spec.val_images, log=log)
        x = torch.stack([frame_tensor(f, spec.size) for f in frames])  # [N, 3, S, S]
        t = torch.tensor([labels.index(v) for v in y])
        n = spec.images
        torch.manual_seed(spec.seed)
        model = tiny_cnn(len(labels), spec.width, spec.stem)
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=1e-4)
        steps = spec.epochs * -(-n // spec.batch)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec.lr, total_steps=steps)
        bar = ProgressLine(log)
        for epoch in range(spec.epochs):
            model.train()
            perm, total = torch.randperm(n), 0.0
            for b in range(0, n, spec.batch):
                idx = perm[b:b + spec.batch]
                xb = x[idx]
                flip = torch.rand(len(idx)) < 0.5  # mirror images: class and colour do not change
                xb = torch.where(flip[:, None, None, None], xb.flip(3), xb)
                loss = torch.nn.functional.cross_entropy(model(xb), t[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                total += float(loss.detach()) * len(idx)
            bar.update(f"  epoch {epoch + 1}/{spec.epochs} loss {total / n:.3f}")
        bar.end()
        model.eval()
        with torch.inference_mode():
            acc = float((model(x[n:]).argmax(1) == t[n:]).float().mean())
        out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({"state_dict": model.state_dict(), "labels": list(labels), "target": spec.target,
                    "size": spec.size, "width": spec.width, "stem": spec.stem}, out_dir / "model.pt")
        _write_record(out_dir, {"fingerprint": fp, "kind": "torch", "spec": dataclasses.asdict(spec),
                                "val_accuracy": round(acc, 4), "fit_seconds": round(time.perf_counter() - start, 1)})
        print(f"{name}: held-out accuracy {acc:.3f}", file=log, flush=True)
    return load_torch_teacher(out_dir, name)


def load_torch_teacher(out_dir: str | Path, name: str = "torch_class") -> TorchTeacher:
    import functools

    import torch

    path = Path(out_dir) / "model.pt"
    if not path.is_file():
        raise TeacherError(f"no torch teacher at {path}; train one with `vlora teachers`")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    model = tiny_cnn(len(blob["labels"]), blob["width"], blob["stem"])
    model.load_state_dict(blob["state_dict"])
    return TorchTeacher(model, functools.partial(frame_tensor, size=blob["size"]), blob["labels"], blob["target"],
                        name=name, detail=f"torch tiny CNN {blob['size']} px ({path})")


__all__ = ["ClassifierSpec", "fit_sklearn_teacher", "load_sklearn_teacher", "fit_torch_teacher",
           "load_torch_teacher", "tiny_cnn", "render_labelled"]
