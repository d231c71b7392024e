"""The on-disk side of distillation: the dataset contract's columns, rows, domain.json, caches.

Contract (one directory per domain): a `datasets.DatasetDict` (train / eval) saved with
`save_to_disk`, and `domain.json`. Every split of every task has the same columns and types,
so datasets of different domains can be concatenated.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable

from .teachers import Answer

DOMAIN_FILE, CREATED_BY = "domain.json", "vlora.distill"


def features():
    from datasets import Features, Image, Sequence, Value

    return Features({
        "id": Value("string"), "domain": Value("string"), "task": Value("string"), "media": Value("string"),
        "image": Image(), "video": Value("string"), "frames": Sequence(Value("int64")),
        "question": Value("string"), "prompt": Value("string"), "label": Value("string"),
        "count": Value("int64"), "boxes": Sequence(Sequence(Value("float32"))), "answer": Value("string"),
        "teacher": Value("string"),
    })


def box_text(cls: str, box: list[float]) -> str:
    return f"{cls} at ({box[0]:.2f}, {box[1]:.2f}, {box[2]:.2f}, {box[3]:.2f})"


def target_fields(task: str, answer: Answer, width: int, height: int, max_count: int | None,
                  max_boxes: int | None) -> dict[str, Any]:
    """label / count / boxes / answer (+ question for lm) of one row from a teacher's answer.

    Counts are clamped to max_count (a count head's last class means "max_count or more").
    Detections keep the max_boxes most confident, normalised to [0, 1] and listed left to right."""
    if task == "count":
        n = min(int(answer.count), max_count) if max_count is not None else int(answer.count)
        return {"label": str(n), "count": n, "boxes": [], "answer": str(n)}
    if task == "detect":
        kept = sorted(answer.boxes or (), key=lambda d: -d.score)[:max_boxes]
        norm = [(d.cls, [min(max(d.box[0] / width, 0.0), 1.0), min(max(d.box[1] / height, 0.0), 1.0),
                         min(max(d.box[2] / width, 0.0), 1.0), min(max(d.box[3] / height, 0.0), 1.0)])
                for d in kept]
        norm.sort(key=lambda cb: (round(cb[1][0], 4), round(cb[1][1], 4)))
        text = "; ".join(box_text(c, b) for c, b in norm) or "none"
        return {"label": "", "count": -1, "boxes": [b for _, b in norm], "answer": text}
    label = answer.label or ""
    return {"label": label, "count": -1, "boxes": [], "answer": label}


def dump_answer(answer: Answer) -> dict[str, Any]:
    """JSON-safe form of an Answer, for the resumable prediction cache."""
    return {"label": answer.label, "count": answer.count, "question": answer.question, "score": answer.score,
            "boxes": None if answer.boxes is None else [[d.cls, d.score, list(d.box), d.color] for d in answer.boxes]}


def load_answer(d: dict[str, Any]) -> Answer:
    from .teachers import Detection

    boxes = None if d["boxes"] is None else tuple(Detection(c, s, tuple(b), col) for c, s, b, col in d["boxes"])
    return Answer(label=d["label"], count=d["count"], boxes=boxes, question=d["question"], score=d["score"])


class AnswerCache:
    """Append-only JSON lines of finished items (id -> record), so an interrupted run resumes."""

    def __init__(self, path: Path):
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self.records[rec["id"]] = rec
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by an interruption: that item is redone
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a")

    def add(self, rec: dict[str, Any]) -> None:
        self.records[rec["id"]] = rec
        self._file.write(json.dumps(rec, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_domain(path: str | os.PathLike) -> dict[str, Any]:
    """domain.json of a distilled domain directory."""
    file = Path(path) / DOMAIN_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no distilled domain at {path}: {DOMAIN_FILE} is missing (run `vlora distill`)")
    return json.loads(file.read_text())


def load_distilled(path: str | os.PathLike):
    """(DatasetDict, domain.json dict) of a distilled domain directory."""
    from datasets import load_from_disk

    meta = read_domain(path)
    return load_from_disk(str(path)), meta


def save_domain(out_dir: Path, rows: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> Path:
    """Writes the DatasetDict and domain.json into a fresh directory and moves it into place, so
    `out_dir` is either the old complete domain or the new complete one."""
    from datasets import Dataset, DatasetDict
    from datasets.utils import logging as ds_logging

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    feats = features()
    dd = DatasetDict({split: Dataset.from_list(split_rows, features=feats) for split, split_rows in rows.items()})
    bars = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()  # our own progress line already covers this step
    try:
        dd.save_to_disk(str(tmp))
    finally:
        if bars:
            ds_logging.enable_progress_bar()
    (tmp / DOMAIN_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    old = out_dir.with_name(f".{out_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def evenly_spaced(n_frames: int, k: int) -> list[int]:
    """k frame indices spread over 0..n_frames-1 (first and last included when k >= 2)."""
    if k >= n_frames:
        return list(range(n_frames))
    if k == 1:
        return [n_frames // 2]
    return [round(i * (n_frames - 1) / (k - 1)) for i in range(k)]


def split_ids(ids: Iterable[str], eval_fraction: float, seed: int) -> tuple[set[str], set[str]]:
    """Seeded train / eval split of item ids (at least one item on each side)."""
    import numpy as np

    ids = sorted(ids)
    n_eval = min(max(1, round(len(ids) * eval_fraction)), len(ids) - 1)
    order = np.random.default_rng(seed).permutation(len(ids))
    eval_ids = {ids[i] for i in order[:n_eval]}
    return set(ids) - eval_ids, eval_ids
