"""Domain datasets in the distiller's on-disk schema, written straight from the world's ground truth.

The trainer's tests (and its learnability measurements) need real `datasets` directories before a
distiller exists, so this writes them from `world` truth: the same columns, features and
domain.json the distiller promises, with teacher {"kind": "labels"}.

    world = write_world(WorldConfig(seed=0), tmp / "world", n_images=32, n_clips=8, progress=False)
    path = write_domain(world, "count_vehicles", tmp / "datasets", zoo_dir / "qwen2_vl_tiny")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from world import WorldIndex, WorldItem, qa_pairs

VEHICLES = ("car", "bus", "truck")  # as conf/dataset/count_vehicles.yaml counts them
COLOR_LABELS = ["red", "green", "blue", "yellow", "white", "black"]
CLASS_LABELS = ["car", "bus", "truck", "person", "bicycle"]
DIRECTION_LABELS = ["left", "right", "up", "down", "stationary"]


def _area(o) -> int:
    x1, y1, x2, y2 = o.box
    return (x2 - x1) * (y2 - y1)


def _largest(item: WorldItem):
    objs = item.truth.objects
    return max(objs, key=lambda o: (_area(o), -o.track_id)) if objs else None


def _norm_box(item: WorldItem, box) -> list[float]:
    w, h = item.truth.width, item.truth.height
    return [box[0] / w, box[1] / h, box[2] / w, box[3] / h]


# name -> (task, media, labels, question, target(item) -> dict of label/count/boxes/answer or None to skip)
def _count(item):
    n = sum(item.truth.counts.get(c, 0) for c in VEHICLES)
    return {"label": str(n), "count": n, "answer": str(n)}


def _color(item):
    o = _largest(item)
    return None if o is None else {"label": o.color, "answer": o.color}


def _cls(item):
    o = _largest(item)
    return None if o is None else {"label": o.cls, "answer": o.cls}


def _direction(item):
    """Motion of the largest moving object ("stationary" when nothing moves)."""
    dirs = item.truth.directions
    moving = [o for o in item.truth.objects if dirs[o.track_id] != "stationary"]
    if not item.truth.objects:
        return None
    d = dirs[max(moving, key=lambda o: (_area(o), -o.track_id)).track_id] if moving else "stationary"
    return {"label": d, "answer": d}


def _exists_bus(item):
    yes = "yes" if item.truth.counts.get("bus", 0) > 0 else "no"
    return {"label": yes, "answer": yes}


def _detect_car(item):
    boxes = [_norm_box(item, o.box) for o in item.truth.objects if o.cls == "car"]
    answer = "; ".join(f"car at ({b[0]:.2f}, {b[1]:.2f}, {b[2]:.2f}, {b[3]:.2f})" for b in boxes) or "none"
    return {"boxes": boxes, "answer": answer}


def _qa(item):
    pairs = qa_pairs(item.truth, np.random.default_rng([item.index, 7]))
    count = [q for q in pairs if q.kind in ("exists", "color")]
    if not count:
        return None
    q = count[item.index % len(count)]
    return {"label": q.answer, "answer": q.answer, "question": q.question}


DOMAINS: dict[str, tuple[str, str, list[str] | None, str, Callable]] = {
    "count_vehicles": ("count", "image", None, "How many vehicles are there?", _count),
    "color_largest": ("classify", "image", COLOR_LABELS, "What color is the largest object?", _color),
    "class_largest": ("classify", "image", CLASS_LABELS, "What kind of object is the largest one?", _cls),
    "direction": ("classify", "clip", DIRECTION_LABELS, "Which way is the largest moving object going?",
                  _direction),
    "exists_bus": ("binary", "image", ["no", "yes"], "Is there a bus?", _exists_bus),
    "detect_car": ("detect", "image", None, "Where are the cars?", _detect_car),
    "qa": ("lm", "image", None, "", _qa),
}


def features():
    from datasets import Features, Image, List, Value

    s, i = Value("string"), Value("int64")
    return Features({"id": s, "domain": s, "task": s, "media": s, "image": Image(), "video": s,
                     "frames": List(i), "question": s, "prompt": s, "label": s, "count": i,
                     "boxes": List(List(Value("float32"))), "answer": s, "teacher": s})


def write_domain(world: WorldIndex, name: str, out_root: str | Path, model_dir: str | Path,
                 eval_fraction: float = 0.2, seed: int = 0, limit: int | None = None, n_frames: int = 4,
                 model_name: str | None = None, out_name: str | None = None) -> Path:
    """Write `<out_root>/<out_name or name>/` (DatasetDict + domain.json) for one of DOMAINS;
    returns the path. Clips show `n_frames` evenly spaced frames."""
    from datasets import Dataset, DatasetDict
    from PIL import Image as PILImage
    from transformers import AutoProcessor

    task, media, labels, question, target = DOMAINS[name]
    processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
    rows: list[dict[str, Any]] = []
    items = world.images if media == "image" else world.clips
    for item in items:
        t = target(item)
        if t is None:
            continue
        q = t.pop("question", question)
        kind = "video" if media == "clip" else "image"
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": q}]}], add_generation_prompt=True)
        row = {"id": f"{item.kind}-{item.index:06d}", "domain": out_name or name, "task": task, "media": media,
               "image": None, "video": "", "frames": [], "question": q, "prompt": prompt,
               "label": "", "count": -1, "boxes": [], "answer": "", "teacher": "ground_truth"}
        if media == "image":
            row["image"] = PILImage.open(item.path).convert("RGB")
        else:
            row["video"] = str(item.path.resolve())
            n = len(item.truth.frames)
            row["frames"] = [int(f) for f in np.linspace(0, n - 1, n_frames).round()]
        row.update(t)
        rows.append(row)
        if limit is not None and len(rows) >= limit:
            break
    order = np.random.default_rng(seed).permutation(len(rows))
    n_eval = max(1, int(round(eval_fraction * len(rows))))
    ev, tr = sorted(order[:n_eval].tolist()), sorted(order[n_eval:].tolist())
    feats = features()
    splits = DatasetDict({"train": Dataset.from_list([rows[i] for i in tr], features=feats),
                          "eval": Dataset.from_list([rows[i] for i in ev], features=feats)})
    out = Path(out_root) / (out_name or name)
    splits.save_to_disk(str(out))
    domain = {"name": out_name or name, "task": task, "labels": labels if task in ("classify", "binary") else None,
              "max_count": max(r["count"] for r in rows) if task == "count" else None,
              "max_boxes": max(len(r["boxes"]) for r in rows) if task == "detect" else None,
              "teacher": {"kind": "labels", "name": "ground_truth", "detail": "world exact labels"},
              "model": model_name or Path(model_dir).name, "media": media,
              "sizes": {"train": len(tr), "eval": len(ev)}, "created_by": "tests.train_fixtures", "version": 1}
    (out / "domain.json").write_text(json.dumps(domain, indent=2) + "\n")
    return out


_CACHE: dict = {}


def tiny_world(root: str | Path) -> WorldIndex:
    """A small world (cached per root): 24 images, 16 short clips."""
    from world import WorldConfig, write_world

    key = ("world", str(root))
    if key not in _CACHE:
        cfg = WorldConfig(seed=3, clip_frames=8, fps=8)  # one-second clips, cheap to render
        _CACHE[key] = write_world(cfg, Path(root) / "world", n_images=24, n_clips=16, progress=False)
    return _CACHE[key]


def tiny_domain(root: str | Path, name: str, model_dir: str | Path, limit: int = 16,
                eval_fraction: float = 0.25) -> Path:
    """`<root>/datasets/<name>` from `tiny_world(root)`, written once per root and settings; written
    again when another limit (or model) wrote that same folder since (a test asking for 12 items must
    not get the 8 another module's call left there)."""
    key = ("domain", str(root), name, str(model_dir), limit)
    path = _CACHE.get(key)
    if path is None or _CACHE.get(("written", str(path))) != key:
        path = write_domain(tiny_world(root), name, Path(root) / "datasets", model_dir, eval_fraction=eval_fraction,
                            limit=limit)
        _CACHE[key], _CACHE[("written", str(path))] = path, key
    return path
