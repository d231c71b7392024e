"""Questions, answers, captions and referring expressions derived from ground truth.

Everything here reads only the truth records, so answers are exact by construction. For a clip,
`truth.objects` and `truth.counts` describe its middle frame; directions span the whole clip.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config import WorldConfig
from .scene import ClipTruth, ImageTruth, ObjectTruth

PLURALS = {"car": "cars", "bus": "buses", "truck": "trucks", "person": "people", "bicycle": "bicycles"}
QA_KINDS = ("count", "exists", "color", "direction")


@dataclass(frozen=True)
class QAPair:
    question: str
    answer: str
    kind: str  # one of QA_KINDS

    def to_dict(self) -> dict[str, Any]:
        return {"question": self.question, "answer": self.answer, "kind": self.kind}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QAPair":
        return cls(d["question"], d["answer"], d["kind"])


def plural(cls: str, n: int = 2) -> str:
    return cls if n == 1 else PLURALS.get(cls, cls + "s")


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def caption(truth: ImageTruth | ClipTruth) -> str:
    """E.g. "A road with 2 cars, 1 bus and 1 person." or "An empty road." (classes in config order)."""
    parts = [f"{n} {plural(c, n)}" for c, n in truth.counts.items() if n > 0]
    return f"A road with {_join(parts)}." if parts else "An empty road."


def _unique(objects: list[ObjectTruth]) -> list[ObjectTruth]:
    """Objects that "the <colour> <class>" picks out on their own."""
    seen = Counter((o.color, o.cls) for o in objects)
    return [o for o in sorted(objects, key=lambda o: o.track_id) if seen[(o.color, o.cls)] == 1]


def qa_pairs(truth: ImageTruth | ClipTruth, rng: np.random.Generator | int,
             colors: tuple[str, ...] | None = None) -> list[QAPair]:
    """Question/answer pairs for one item; the same truth and rng state give the same list.

    count: every class present plus one absent class (answer "0"); exists: one present and one
    absent colour/class pair (`colors` are the candidate colours, default: the config default);
    color: each class with exactly one instance; direction (clips): each object unique by colour
    and class, answered with left/right/up/down/stationary.
    """
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    objs, counts = truth.objects, truth.counts
    classes = list(counts)
    out: list[QAPair] = []
    present = [c for c in classes if counts[c] > 0]
    absent = [c for c in classes if counts[c] == 0]
    asked = present + ([absent[int(rng.integers(len(absent)))]] if absent else [])
    for c in asked:
        out.append(QAPair(f"How many {plural(c)} are there?", str(counts[c]), "count"))
    pairs = {(o.color, o.cls) for o in objs}
    if objs:
        o = objs[int(rng.integers(len(objs)))]
        out.append(QAPair(f"Is there {_a(o.color)} {o.cls}?", "yes", "exists"))
    palette = colors if colors is not None else WorldConfig().colors
    missing = [(c, k) for c in palette for k in classes if (c, k) not in pairs]
    if missing:
        c, k = missing[int(rng.integers(len(missing)))]
        out.append(QAPair(f"Is there {_a(c)} {k}?", "no", "exists"))
    for c in present:
        if counts[c] == 1:
            o = next(o for o in objs if o.cls == c)
            out.append(QAPair(f"What color is the {c}?", o.color, "color"))
    if isinstance(truth, ClipTruth):
        for o in _unique(objs):
            out.append(QAPair(f"Which way is the {o.color} {o.cls} moving?",
                              truth.directions[o.track_id], "direction"))
    return out


def referring_expressions(truth: ImageTruth | ClipTruth) -> list[tuple[str, tuple[int, int, int, int]]]:
    """(expression, box) for every object a phrase names unambiguously: "the red car" when it is the
    only red car, and also "the car" when it is the only car. Clip boxes are middle-frame boxes."""
    objs = truth.objects
    per_class = Counter(o.cls for o in objs)
    out = []
    for o in _unique(objs):
        out.append((f"the {o.color} {o.cls}", o.box))
        if per_class[o.cls] == 1:
            out.append((f"the {o.cls}", o.box))
    return out
