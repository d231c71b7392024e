"""Video files and on-disk worlds: images/, clips/, truth.jsonl and world.json.

A world directory is written item by item. Each finished item's record is appended to
truth.partial.jsonl, so an interrupted run can be resumed: items whose file and record exist are
kept, the rest are rendered again (rendering is deterministic), and at the end truth.jsonl is
written in index order and world.json is marked complete. A resumed run therefore ends with the
same truth.jsonl and image bytes as an uninterrupted one.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import cv2
import numpy as np

from .progress import ProgressLine
from .qa import QAPair, caption, qa_pairs
from .render import render_clip, render_image
from .config import CLIP_KIND, IMAGE_KIND, WorldConfig
from .scene import ClipTruth, ImageTruth, truth_from_dict

TRUTH, PARTIAL, META = "truth.jsonl", "truth.partial.jsonl", "world.json"
# (suffix, fourcc) tried in order; MJPG/AVI is the fallback for OpenCV builds without mp4v.
CODECS: tuple[tuple[str, str], ...] = ((".mp4", "mp4v"), (".avi", "MJPG"))


def write_video(path: str | os.PathLike, frames: Sequence[np.ndarray], fps: float) -> Path:
    """Write BGR uint8 frames; returns the path written (suffix may change to the fallback's)."""
    path = Path(path)
    if not frames:
        raise ValueError(f"write_video({path}): no frames given")
    h, w = frames[0].shape[:2]
    for i, f in enumerate(frames):
        if f.shape != (h, w, 3) or f.dtype != np.uint8:
            raise ValueError(f"write_video({path}): frame {i} is {f.shape} {f.dtype}, "
                             f"expected {(h, w, 3)} uint8 like frame 0")
    if w % 2 or h % 2:  # the encoders would silently crop a row/column away
        raise ValueError(f"write_video({path}): frame size {w}x{h} must be even in both dimensions")
    tried = []
    for suffix, fourcc in CODECS:
        target = path.with_suffix(suffix)
        writer = cv2.VideoWriter(str(target), cv2.VideoWriter_fourcc(*fourcc), float(fps), (w, h))
        ok = writer.isOpened()
        if ok:
            for f in frames:
                writer.write(f)
        writer.release()
        if ok and target.exists() and target.stat().st_size > 0:
            return target
        target.unlink(missing_ok=True)
        tried.append(f"{fourcc} in {target.name}")
    raise RuntimeError(f"could not write video {path}: OpenCV could not encode with {', '.join(tried)}")


def read_video(path: str | os.PathLike) -> list[np.ndarray]:
    """All frames of a video as BGR uint8 arrays."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"video not found: {path}")
    cap = cv2.VideoCapture(str(path))
    try:
        if not cap.isOpened():
            raise IOError(f"OpenCV cannot open video {path}")
        frames = []
        while True:
            ok, frame = cap.read()
            if not ok:
                break
            frames.append(frame)
    finally:
        cap.release()
    if not frames:
        raise IOError(f"no frames could be read from video {path}")
    return frames


@dataclass
class WorldItem:
    kind: str  # "image" or "clip"
    index: int
    file: str  # relative to the world root
    truth: ImageTruth | ClipTruth
    qa: list[QAPair]
    caption: str
    root: Path

    @property
    def path(self) -> Path:
        return self.root / self.file

    def load(self) -> np.ndarray | list[np.ndarray]:
        """The image (HxWx3 BGR) or the clip's frames."""
        if self.kind == "clip":
            return read_video(self.path)
        img = cv2.imread(str(self.path), cv2.IMREAD_COLOR)
        if img is None:
            raise IOError(f"cannot read image {self.path}")
        return img

    @classmethod
    def from_record(cls, rec: dict[str, Any], root: Path) -> "WorldItem":
        return cls(rec["kind"], rec["index"], rec["file"], truth_from_dict(rec["truth"]),
                   [QAPair.from_dict(q) for q in rec["qa"]], rec["caption"], root)


@dataclass
class WorldIndex:
    root: Path
    config: WorldConfig
    items: list[WorldItem]

    @property
    def images(self) -> list[WorldItem]:
        return [it for it in self.items if it.kind == "image"]

    @property
    def clips(self) -> list[WorldItem]:
        return [it for it in self.items if it.kind == "clip"]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[WorldItem]:
        return iter(self.items)

    def __getitem__(self, i: int) -> WorldItem:
        return self.items[i]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_records(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    recs: dict[tuple[str, int], dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                recs[(rec["kind"], int(rec["index"]))] = rec
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by an interruption; that item is redone
    return recs


def _render_item(cfg: WorldConfig, root: Path, kind: str, index: int) -> dict[str, Any]:
    stem = f"{kind}s/{kind}_{index:05d}"
    (root / f"{kind}s").mkdir(exist_ok=True)
    if kind == "image":
        frame, truth = render_image(cfg, index)
        tmp, final = root / f"{stem}.part.png", root / f"{stem}.png"
        if not cv2.imwrite(str(tmp), frame):
            raise IOError(f"cannot write image {tmp}")
    else:
        frames, truth = render_clip(cfg, index)
        tmp = write_video(root / f"{stem}.part.mp4", frames, cfg.fps)
        final = root / f"{stem}{tmp.suffix}"
    os.replace(tmp, final)  # a file under its final name is always complete
    code = IMAGE_KIND if kind == "image" else CLIP_KIND
    qa = qa_pairs(truth, np.random.default_rng([cfg.seed, code, index, 1]), cfg.colors)
    return {"kind": kind, "index": index, "file": final.relative_to(root).as_posix(),
            "truth": truth.to_dict(), "qa": [q.to_dict() for q in qa], "caption": caption(truth)}


@contextlib.contextmanager
def _renderer(cfg: WorldConfig, root: Path, workers: int, n: int):
    """A function from (kind, index) keys to their records, rendered in order: in this process, or
    by `workers` processes (spawned: the caller may hold threads, a torch runtime, say)."""
    if workers <= 1 or n <= 1:
        yield lambda keys: (_render_item(cfg, root, kind, index) for kind, index in keys)
        return
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(workers, n), mp_context=ctx, initializer=cv2.setNumThreads,
                                                initargs=(1,)) as pool:  # a core each, not all of them each
        yield lambda keys: pool.map(_render_item, *zip(*[(cfg, root, kind, index) for kind, index in keys]),
                                    chunksize=max(1, min(8, n // (4 * workers))))


def _check_config(root: Path, cfg: WorldConfig) -> None:
    meta = root / META
    if not meta.exists():
        if (root / TRUTH).exists() or (root / PARTIAL).exists():
            raise ValueError(f"{root} has truth records but no {META}; cannot tell its config, "
                             f"use an empty directory")
        return
    old = json.loads(meta.read_text()).get("config", {})
    new = cfg.to_dict()
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if diff:
        raise ValueError(f"{root} holds a world written with a different config "
                         f"(differs in {', '.join(diff)}); use another directory or the same config")


def write_world(cfg: WorldConfig, out_dir: str | os.PathLike, n_images: int, n_clips: int,
                progress: bool = True, workers: int = 0) -> WorldIndex:
    """Write (or finish writing) images 0..n_images-1 and clips 0..n_clips-1 under `out_dir`.

    workers: processes rendering in parallel (0 or 1: this one). Every item is drawn from its
    index alone, so the world is the same whatever the count, and records are kept in order.
    """
    for name, n in (("n_images", n_images), ("n_clips", n_clips), ("workers", workers)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    _check_config(root, cfg)
    _write_atomic(root / META, json.dumps({"complete": False, "config": cfg.to_dict()}, indent=2))
    recs = _read_records(root / TRUTH)
    recs.update(_read_records(root / PARTIAL))
    todo = [("image", i) for i in range(n_images)] + [("clip", i) for i in range(n_clips)]
    kept = {key: rec for key, rec in recs.items() if (root / rec["file"]).exists()}
    missing = [key for key in todo if key not in kept]
    out, made, last, bar = [], 0, 0.0, ProgressLine(sys.stderr)
    with open(root / PARTIAL, "a") as log, _renderer(cfg, root, workers, len(missing)) as render:
        rendered = render(missing)
        for k, key in enumerate(todo):
            rec = kept.get(key)
            if rec is None:
                rec = next(rendered)
                log.write(_dumps(rec) + "\n")
                log.flush()
                made += 1
            out.append(rec)
            if progress and (time.monotonic() - last > 0.1 or k == len(todo) - 1):
                last = time.monotonic()
                bar.update(f"world {root}: {k + 1}/{len(todo)} items ({made} rendered, {k + 1 - made} kept)")
    if progress and todo:
        bar.end()
    _write_atomic(root / TRUTH, "".join(_dumps(r) + "\n" for r in out))
    totals = {c: 0 for c in cfg.classes}
    for r in out:
        for c, n in r["truth"]["counts"].items():
            totals[c] += n
    meta = {"complete": True, "config": cfg.to_dict(),
            "counts": {"images": n_images, "clips": n_clips, "objects": totals}}
    _write_atomic(root / META, json.dumps(meta, indent=2))
    (root / PARTIAL).unlink(missing_ok=True)
    return WorldIndex(root, cfg, [WorldItem.from_record(r, root) for r in out])


def load_world(out_dir: str | os.PathLike) -> WorldIndex:
    """Read a world written by `write_world`."""
    root = Path(out_dir)
    if not (root / META).exists():
        raise FileNotFoundError(f"no world at {root}: {META} is missing (write one with write_world)")
    meta = json.loads((root / META).read_text())
    if not meta.get("complete") or not (root / TRUTH).exists():
        raise ValueError(f"the world at {root} is unfinished; run write_world again with its config")
    cfg = WorldConfig.from_dict(meta["config"])
    items = [WorldItem.from_record(json.loads(line), root)
             for line in (root / TRUTH).read_text().splitlines() if line.strip()]
    return WorldIndex(root, cfg, items)
