"""Text queries about images: what kind each is, the JSON-lines query file, and queries with
known answers made from a synthetic world's ground truth.

Query file, one object per line:
    {"image": "image_00003.png", "question": "How many cars are there?", "answer": "2"}
    {"image": "image_00003.png", "question": "Where is the red car?", "box": [12, 40, 52, 60]}
    {"image": "photo.jpg", "question": "Describe the image.", "kind": "caption"}
    {"image": "d0007.png", "question": "Which digit is this?", "answer": "7", "split": "eval"}
`answer` (or `answers`, several acceptable ones) and `box` (pixels of the image) are optional;
`kind` defaults to the kind read off the question (`classify`), and a question that a manifest
domain asked takes that domain's kind when the app routes it (app.py). Any other key is the
query's own metadata (`meta`): kept as it is and carried into its result.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from world import referring_expressions

KNOWN_KEYS = ("image", "question", "kind", "answer", "answers", "box", "id")  # others: the query's metadata
KINDS = ("caption", "ground", "count", "exists", "color", "direction", "classify", "qa")
_RULES = (("caption", r"^(describe|caption)\b|\bcaption\b"),
          ("ground", r"^(where (is|are)|locate|find|point to|box)\b"),
          ("count", r"^how many\b"),
          ("color", r"^what colou?r\b"),
          ("direction", r"^which (way|direction)\b"),
          ("exists", r"^(is|are|does|do) (there|the|a|an)\b"))


def classify(question: str) -> str:
    """The kind of a question, from its wording; "qa" when no rule matches."""
    q = question.strip().lower()
    for kind, pattern in _RULES:
        if re.search(pattern, q):
            return kind
    return "qa"


@dataclass
class Query:
    image: str  # name in the collection
    question: str
    kind: str = ""  # "" = classify(question)
    answers: list[str] = field(default_factory=list)  # acceptable answers, when known
    box: list[float] | None = None  # the referred object's box (x1, y1, x2, y2) in image pixels, when known
    id: str = ""
    meta: dict[str, Any] = field(default_factory=dict)  # the query line's other keys, carried into its result
    guessed: bool = False  # the kind was read off the wording, not given: a domain's question may set it

    def __post_init__(self) -> None:
        if not isinstance(self.question, str) or not self.question.strip():
            raise ValueError(f"query {self.id or self.image!r}: question must be a non-empty string")
        if not self.kind:
            self.kind, self.guessed = classify(self.question), True
        if self.kind not in KINDS:
            raise ValueError(f"query {self.id or self.image!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.box is not None and (len(self.box) != 4 or not all(isinstance(v, (int, float)) for v in self.box)):
            raise ValueError(f"query {self.id or self.image!r}: box must be [x1, y1, x2, y2], got {self.box!r}")

    @property
    def known(self) -> bool:
        return bool(self.answers) or self.box is not None

    def to_dict(self) -> dict[str, Any]:
        """The query line: its metadata keys beside the known ones, a guessed kind left out."""
        d = asdict(self)
        meta, guessed = d.pop("meta"), d.pop("guessed")
        if d["box"] is None:
            del d["box"]
        if guessed:
            del d["kind"]
        return {**meta, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any], line: int | None = None) -> "Query":
        where = f"line {line}" if line is not None else "query"
        if not isinstance(d, dict) or "image" not in d or "question" not in d:
            raise ValueError(f"{where}: a query needs 'image' and 'question', got {d!r}")
        meta = {k: v for k, v in d.items() if k not in KNOWN_KEYS}  # the user's own keys: passed through
        answers = d.get("answers") or ([] if d.get("answer") is None else [d["answer"]])
        if isinstance(answers, str):  # one answer given as `answers`: not its characters
            answers = [answers]
        if not isinstance(answers, list):
            raise ValueError(f"{where}: answers must be a list of strings, got {answers!r}")
        return cls(str(d["image"]), d["question"], d.get("kind") or "", [str(a) for a in answers], d.get("box"),
                   str(d.get("id", line if line is not None else "")), meta)


def read_queries(path: str | os.PathLike, skipped: list[dict[str, Any]] | None = None) -> list[Query]:
    """The queries of a JSON-lines file. A malformed line (not JSON, a missing key, a bad kind, box
    or answers; other keys are the query's metadata, not an error) raises ValueError, unless `skipped` is a list: then the line is left out and
    {"line": n, "error": why} appended to it, so one bad line does not cost the whole batch."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {i} is not valid JSON: {e}") from None
            out.append(Query.from_dict(d, i))
        except (ValueError, TypeError) as e:
            if skipped is None:
                raise
            why = str(e)
            skipped.append({"line": i, "error": why if f"line {i}" in why else f"line {i}: {why}"})
    return out


def write_queries(queries: list[Query], path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(q.to_dict()) + "\n" for q in queries), encoding="utf-8")
    return p


def world_queries(collection, per_image: int = 3, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> list[Query]:
    """Queries with exact answers for the images of a collection that has world truth: the
    world's question/answer pairs, a caption request and referring expressions (boxes);
    `per_image` of them per image, picked with `seed`, spread over the kinds where possible."""
    rng = np.random.default_rng(seed)
    out = []
    for name in collection.names:
        item = collection.truth(name)
        if item is None:
            continue
        pool: dict[str, list[Query]] = {}
        for qa in item.qa:
            pool.setdefault(qa.kind, []).append(Query(name, qa.question, qa.kind, [qa.answer]))
        pool["caption"] = [Query(name, "Describe the image.", "caption", [item.caption])]
        for expr, box in referring_expressions(item.truth):
            grounding = Query(name, f"Where is {expr}?", "ground", box=[float(v) for v in box])
            pool.setdefault("ground", []).append(grounding)
        order = [k for k in rng.permutation(sorted(pool)) if k in kinds]
        picked = []
        while len(picked) < per_image and any(pool[k] for k in order):
            for k in order:
                if pool[k] and len(picked) < per_image:
                    picked.append(pool[k].pop(int(rng.integers(len(pool[k])))))
        out += picked
    for i, q in enumerate(out):
        q.id = str(i)
    return out
