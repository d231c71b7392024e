"""Ultralytics YOLO detectors as teachers, and the switches that keep ultralytics offline.

Any detection checkpoint ultralytics loads works: `YoloTeacher("runs/detect/train/weights/best.pt")`
or a published COCO model (its class names car/bus/truck/person/bicycle match the world's).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from .base import DETECTOR_TARGETS, Detection, Teacher, TeacherError, check_frame

# ultralytics reads these when it is first imported: no online checks, no hub events.
os.environ.setdefault("YOLO_OFFLINE", "1")
_FONTS = ("Arial.ttf", "Arial.Unicode.ttf")


_threads_lock = threading.Lock()
_threads_depth = 0
_threads_saved: tuple | None = None


def _thread_settings() -> tuple:
    import torch

    try:
        import cv2
        cv_threads = cv2.getNumThreads()
    except ImportError:
        cv_threads = None
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"), cv_threads


def _restore_thread_settings(saved: tuple) -> None:
    import torch

    torch_threads, omp, cv_threads = saved
    torch.set_num_threads(torch_threads)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp
    if cv_threads is not None:
        import cv2
        cv2.setNumThreads(cv_threads)


@contextlib.contextmanager
def process_threads_kept():
    """Runs a call into ultralytics and puts the process's thread settings back after it.

    ultralytics tunes the whole process for its own CPU training: importing it sets
    OMP_NUM_THREADS=1 (which every child process started later inherits) and cv2.setNumThreads(0),
    and choosing a CPU device sets torch to min(8, cores - 1) threads, 1 on a 2-core machine. The
    pretraining and fusion that run after a YOLO teacher in the same process then ran on that one
    thread. Calls may overlap (teacher threads): the first in saves, the last out restores.
    """
    global _threads_depth, _threads_saved
    with _threads_lock:
        if _threads_depth == 0:
            _threads_saved = _thread_settings()
        _threads_depth += 1
    try:
        yield
    finally:
        with _threads_lock:
            _threads_depth -= 1
            if _threads_depth == 0:
                _restore_thread_settings(_threads_saved)


def ultralytics_offline(config_dir: str | os.PathLike | None = None):
    """Imports ultralytics so that it never reaches the network; returns the module.

    ultralytics downloads Arial.ttf into its config directory whenever it checks a dataset, and
    sends usage events when `sync` is on. We point its config directory at `config_dir` (when it
    is not imported yet and YOLO_CONFIG_DIR is unset; no config_dir: ultralytics/ under VLORA_HOME,
    never the user's ~/.config), switch events off and place a local font (matplotlib's DejaVu
    Sans) under the names it looks for. AMP checks only run on CUDA devices.
    """
    home = Path(os.environ.get("VLORA_HOME") or ".vlora")  # as conf/paths/default.yaml
    if "ultralytics" not in sys.modules:
        config_dir = Path(config_dir) if config_dir is not None else home / "ultralytics"
        config_dir.mkdir(parents=True, exist_ok=True)
        # absolute: child processes inherit the variable, and a relative one would land in their cwd
        os.environ.setdefault("YOLO_CONFIG_DIR", str(config_dir.resolve()))
    if "matplotlib" not in sys.modules:  # its font cache (vlora.home pins both for every command)
        os.environ.setdefault("MPLCONFIGDIR", str((home / "matplotlib").resolve()))
    import matplotlib
    with process_threads_kept():  # its import sets OMP_NUM_THREADS and OpenCV's threads
        import ultralytics
        from ultralytics.utils import SETTINGS, USER_CONFIG_DIR

    font = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    for name in _FONTS:
        target = Path(USER_CONFIG_DIR) / name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(font, target)
    if SETTINGS.get("sync"):
        SETTINGS.update(sync=False)
    return ultralytics


def _weights_imgsz(model) -> int | None:
    """The image size a checkpoint was trained at (ultralytics stores its train args), if known."""
    args = getattr(model, "ckpt", None) or {}
    imgsz = (args.get("train_args") or {}).get("imgsz") if isinstance(args, dict) else None
    return int(imgsz) if isinstance(imgsz, (int, float)) else None


class YoloTeacher(Teacher):
    """An ultralytics detector. Frames are RGB; ultralytics takes numpy input as BGR, so they are
    flipped on the way in. Class names come from the checkpoint."""

    kind = "yolo"
    targets = DETECTOR_TARGETS
    is_detector = True

    def __init__(self, weights: str | os.PathLike, name: str | None = None, conf: float = 0.25,
                 iou: float = 0.6, imgsz: int | None = None, agnostic_nms: bool = True,
                 config_dir: str | os.PathLike | None = None):
        weights = Path(weights)
        if not weights.is_file():
            raise TeacherError(f"YOLO weights not found: {weights} (train the default detector with "
                               f"`vlora teachers`, or point to a .pt file ultralytics can load)")
        if not 0.0 <= conf <= 1.0:
            raise TeacherError(f"YOLO conf must be in [0, 1], got {conf}")
        ultralytics_offline(config_dir)
        from ultralytics import YOLO

        with process_threads_kept():
            self.model = YOLO(str(weights))
        if self.model.task != "detect":
            raise TeacherError(f"{weights} is a YOLO {self.model.task!r} model; a detection model is needed")
        names = self.model.names
        self.classes = tuple(names[i] for i in sorted(names))
        self.name = name or f"yolo:{weights.stem}"
        # class-agnostic NMS: one object seen as both "bus" and "truck" stays one detection
        self.conf, self.iou, self.agnostic_nms = conf, iou, agnostic_nms
        self.imgsz = imgsz or _weights_imgsz(self.model) or 640
        self.weights = weights
        self.detail = (f"ultralytics YOLO {weights} ({len(self.classes)} classes, imgsz {self.imgsz}, conf {conf}"
                       f"{', class-agnostic NMS' if agnostic_nms else ''})")

    def detect(self, frame: np.ndarray) -> list[Detection]:
        return self.detect_batch([frame])[0]

    def detect_batch(self, frames: Sequence[np.ndarray], batch: int = 32) -> list[list[Detection]]:
        out: list[list[Detection]] = []
        for start in range(0, len(frames), batch):
            chunk = [np.ascontiguousarray(check_frame(f)[..., ::-1]) for f in frames[start:start + batch]]
            with process_threads_kept():  # its first predict picks the CPU device, and torch's threads with it
                results = self.model.predict(chunk, imgsz=self.imgsz, conf=self.conf, iou=self.iou,
                                             agnostic_nms=self.agnostic_nms, device="cpu", verbose=False)
            for r in results:
                xyxy = r.boxes.xyxy.cpu().numpy()   # [N, 4] pixels of the input frame
                cls = r.boxes.cls.cpu().numpy().astype(int)
                score = r.boxes.conf.cpu().numpy()
                out.append([Detection(self.classes[c], float(s), tuple(float(v) for v in b))
                            for b, c, s in zip(xyxy, cls, score)])
        return out
