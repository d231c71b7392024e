"""Our own YOLO detector for the synthetic world: dataset on disk, a small architecture, training.

No weights can be downloaded, so the default detector teacher is trained here from random
initialisation: `write_yolo_dataset` renders world images with their exact boxes into the
layout ultralytics reads (images/{train,val}, labels/{train,val}, data.yaml), `TINY_ARCH` is a
YOLOv8-style network with two output strides (8 and 16; the world's objects are 9-79 px at
224 px) and about 0.45 M parameters, and `train_world_yolo` trains it on CPU (default 400 images,
20 epochs at 128 px: about 70 CPU-seconds, val mAP50 ~0.8) and caches the weights.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import cv2

from world import WorldConfig, render_image
from world.progress import ProgressLine

from .yolo import process_threads_kept, ultralytics_offline

# YOLOv8 blocks at explicit widths (depth/width multiples 1). Detect heads at P3/8 and P4/16 only;
# reg_max 8 bins of DFL reach 7 strides from a cell centre, i.e. boxes up to 112 / 224 px.
TINY_ARCH = """\
nc: {nc}
reg_max: 8
depth_multiple: 1.0
width_multiple: 1.0
backbone:
  - [-1, 1, Conv, [16, 3, 2]]   # 0 P1/2
  - [-1, 1, Conv, [32, 3, 2]]   # 1 P2/4
  - [-1, 1, C2f, [32, True]]
  - [-1, 1, Conv, [48, 3, 2]]   # 3 P3/8
  - [-1, 1, C2f, [48, True]]
  - [-1, 1, Conv, [96, 3, 2]]   # 5 P4/16
  - [-1, 1, C2f, [96, True]]
  - [-1, 1, SPPF, [96, 5]]      # 7
head:
  - [-1, 1, nn.Upsample, [None, 2, "nearest"]]
  - [[-1, 4], 1, Concat, [1]]
  - [-1, 1, C2f, [48]]          # 10 (P3/8 out)
  - [-1, 1, Conv, [48, 3, 2]]
  - [[-1, 7], 1, Concat, [1]]
  - [-1, 1, C2f, [96]]          # 13 (P4/16 out)
  - [[10, 13], 1, Detect, [nc]]
"""
WEIGHTS, RECORD = "weights.pt", "teacher.json"


@dataclass(frozen=True)
class YoloWorldSpec:
    """How the default detector is trained. `world` overrides WorldConfig fields of its images."""
    seed: int = 1000          # world seed of the training images (distillation uses other seeds)
    images: int = 400
    val_images: int = 60
    epochs: int = 20
    imgsz: int = 128
    batch: int = 16
    lr: float = 0.004
    world: dict = dataclasses.field(default_factory=dict)

    def world_config(self) -> WorldConfig:
        return WorldConfig.from_dict({**self.world, "seed": self.seed})

    def fingerprint(self) -> str:
        blob = json.dumps({"spec": dataclasses.asdict(self), "arch": TINY_ARCH}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def yolo_label_lines(truth, classes: tuple[str, ...]) -> list[str]:
    """ultralytics label lines "cls cx cy w h" (normalised) of one image's truth."""
    W, H = truth.width, truth.height
    lines = []
    for o in truth.objects:
        x1, y1, x2, y2 = o.box
        lines.append(f"{classes.index(o.cls)} {(x1 + x2) / 2 / W:.6f} {(y1 + y2) / 2 / H:.6f} "
                     f"{(x2 - x1) / W:.6f} {(y2 - y1) / H:.6f}")
    return lines


def write_yolo_dataset(cfg: WorldConfig, root: str | Path, n_train: int, n_val: int,
                       log: TextIO | None = None) -> Path:
    """Renders world images 0..n_train-1 (train) and n_train..n_train+n_val-1 (val) with their
    boxes; returns data.yaml. Images already on disk are kept (rendering is deterministic)."""
    root = Path(root)
    for name, n in (("n_train", n_train), ("n_val", n_val)):
        if n < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
    total, done, bar = n_train + n_val, 0, ProgressLine(log or sys.stderr)
    for split, indices in (("train", range(n_train)), ("val", range(n_train, total))):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        for i in indices:
            img, lab = root / "images" / split / f"{i:06d}.png", root / "labels" / split / f"{i:06d}.txt"
            if not (img.exists() and lab.exists()):
                frame, truth = render_image(cfg, i)
                lines = yolo_label_lines(truth, cfg.classes)
                lab.write_text("".join(line + "\n" for line in lines))
                if not cv2.imwrite(str(img), frame):
                    raise IOError(f"cannot write {img}")
            done += 1
            if done % 50 == 0 or done == total:
                bar.update(f"yolo dataset {root}: {done}/{total} images")
    bar.end()
    names = "\n".join(f"  {i}: {c}" for i, c in enumerate(cfg.classes))
    data = root / "data.yaml"
    data.write_text(f"path: {root.resolve()}\ntrain: images/train\nval: images/val\nnames:\n{names}\n")
    return data


def read_record(out_dir: str | Path) -> dict[str, Any] | None:
    path = Path(out_dir) / RECORD
    return json.loads(path.read_text()) if path.exists() else None


def train_world_yolo(spec: YoloWorldSpec, out_dir: str | Path, config_dir: str | Path | None = None,
                     log: TextIO | None = None) -> Path:
    """Trains the default detector into `out_dir` (weights.pt + teacher.json with its validation
    mAP) and returns the weights; reuses them when they were trained from the same spec."""
    out_dir = Path(out_dir).resolve()  # ultralytics puts a relative `project` under its own runs dir
    rec = read_record(out_dir)
    if rec and rec.get("fingerprint") == spec.fingerprint() and (out_dir / WEIGHTS).is_file():
        return out_dir / WEIGHTS
    log = log or sys.stderr
    cfg = spec.world_config()
    ultralytics_offline(config_dir or out_dir.parent / "ultralytics")
    import torch
    from ultralytics import YOLO

    data = write_yolo_dataset(cfg, out_dir / "data", spec.images, spec.val_images, log)
    arch = out_dir / "model.yaml"
    arch.write_text(TINY_ARCH.format(nc=len(cfg.classes)))
    with process_threads_kept():  # ultralytics trains with its own thread settings, then the process gets its back
        torch.manual_seed(spec.seed)
        model = YOLO(str(arch), task="detect")
        start = time.perf_counter()
        print(f"yolo: training {arch.name} on {spec.images} world images, {spec.epochs} epochs at "
              f"{spec.imgsz} px (CPU)", file=log, flush=True)
        # No mosaic or flips: the test frames are whole scenes, and heading matters to no class.
        model.train(data=str(data), epochs=spec.epochs, imgsz=spec.imgsz, batch=spec.batch, device="cpu",
                    workers=0, cache="ram", project=str(out_dir), name="run", exist_ok=True, pretrained=False,
                    optimizer="AdamW", lr0=spec.lr, warmup_epochs=1, close_mosaic=0, mosaic=0.0, fliplr=0.0,
                    hsv_h=0.0, translate=0.1, scale=0.2, amp=False, plots=False, val=False, seed=spec.seed,
                    deterministic=False, verbose=False)
        seconds = time.perf_counter() - start
        last = out_dir / "run" / "weights" / "last.pt"
        if not last.is_file():
            raise RuntimeError(f"ultralytics finished without writing {last}")
        # the trainer's final validation (of best.pt, which is last.pt without per-epoch val) has the metrics
        det = getattr(getattr(model.trainer, "validator", None), "metrics", None)
        metrics = _summarise(det, cfg.classes) if hasattr(det, "box") else evaluate_yolo(last, data, spec.imgsz)
    tmp = out_dir / (WEIGHTS + ".tmp")
    shutil.copyfile(last, tmp)
    tmp.replace(out_dir / WEIGHTS)
    record = {"fingerprint": spec.fingerprint(), "spec": dataclasses.asdict(spec), "classes": list(cfg.classes),
              "train_seconds": round(seconds, 1), "val": metrics}
    (out_dir / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    print(f"yolo: trained in {seconds:.0f} s, val mAP50 {metrics['map50']:.3f}, mAP50-95 {metrics['map']:.3f}",
          file=log, flush=True)
    return out_dir / WEIGHTS


def save_untrained_yolo(path: str | Path, classes: tuple[str, ...], config_dir: str | Path | None = None,
                        seed: int = 0) -> Path:
    """A randomly initialised TINY_ARCH detector with `classes`, saved as a checkpoint any
    ultralytics YOLO loads (smoke tests, or a starting point for training elsewhere)."""
    path = Path(path)
    ultralytics_offline(config_dir or path.parent / "ultralytics")
    import torch
    from ultralytics import YOLO

    path.parent.mkdir(parents=True, exist_ok=True)
    arch = path.with_suffix(".yaml")
    arch.write_text(TINY_ARCH.format(nc=len(classes)))
    torch.manual_seed(seed)
    with process_threads_kept():
        model = YOLO(str(arch), task="detect")
        model.model.names = dict(enumerate(classes))
        model.save(str(path))
    return path


def evaluate_yolo(weights: str | Path, data: str | Path, imgsz: int) -> dict[str, Any]:
    """mAP50, mAP50-95 and per-class mAP50-95 of a checkpoint on the dataset's val split."""
    from ultralytics import YOLO

    with process_threads_kept():
        model = YOLO(str(weights))
        res = model.val(data=str(data), imgsz=imgsz, batch=32, device="cpu", workers=0, plots=False,
                        verbose=False, project=str(Path(weights).resolve().parent.parent), name="val", exist_ok=True)
    return _summarise(res, [model.names[i] for i in sorted(model.names)])


def _summarise(det, names) -> dict[str, Any]:
    """mAP50, mAP50-95 and per-class mAP50-95 of ultralytics DetMetrics."""
    return {"map50": round(float(det.box.map50), 4), "map": round(float(det.box.map), 4),
            "per_class_map": {names[i]: round(float(v), 4) for i, v in enumerate(det.box.maps)}}
