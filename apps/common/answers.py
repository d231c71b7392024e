"""Answers from either output mode, as one `Prediction`: a task head's structured output, or the
LM head's text parsed for a count, a yes / no, a label or boxes.

Boxes in text are "(x1, y1, x2, y2)" (square brackets also do). Their unit is `scale`:
"unit" (fractions of the frame, the distilled detection answers: "car at (0.12, 0.30, ...)"),
"percent" (integer percentages, the pre-training answers: "(12, 30, 25, 41)"), "pixel", or
"auto": unit when every value is <= 1, percent when every value is <= 100, else pixel.
Head boxes are always unit boxes. Predictions carry boxes in pixels of the frame sent.

Qwen2-VL's native grounding form, "<|object_ref_start|>the red car<|object_ref_end|>
<|box_start|>(x1,y1),(x2,y2)<|box_end|>" (or the bare "(x1,y1),(x2,y2)" left when special tokens
are skipped in decoding), is read as well: on a 0-1000 grid of the frame (Qwen2-VL), or, given
`native_size`, as absolute pixels of an input of that (width, height) (Qwen2.5-VL's resized input).
Given `native_size`, Qwen2.5-VL's JSON form `{"bbox_2d": [x1, y1, x2, y2], "label": ...}` is read in
those pixels too.

Box matching (`match_boxes`) is greedy by IoU, each box used once, a pair counting at IoU >= 0.5,
like `heads.metrics.detection_counts`; written here in plain Python so a client needs no torch.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty".split())}
SCALES = ("auto", "unit", "percent", "pixel")
_NUM = r"(-?\d+(?:\.\d+)?)"
_BOX = re.compile(r"[\(\[]\s*" + r"\s*,\s*".join([_NUM] * 4) + r"\s*[\)\]]")
_POINT = r"\(\s*" + _NUM + r"\s*,\s*" + _NUM + r"\s*\)"
_NATIVE_BOX = re.compile(r"(?:<\|box_start\|>\s*)?" + _POINT + r"\s*,\s*" + _POINT + r"(?:\s*<\|box_end\|>)?")
_BBOX_2D = re.compile(r"[\"']bbox_2d[\"']\s*:\s*$")  # just before a box: Qwen2.5-VL's JSON form
NATIVE_GRID = 1000.0  # Qwen2-VL's box coordinates: [0, 1000) of the image's width and height
_INT = re.compile(r"(?<![\w.])(\d+)(?!\w|\.\d)")  # whole numbers, not parts of "0.25" or "x2"
_WORD = re.compile(r"[a-z]+")

Box = tuple[float, float, float, float]


@dataclass
class Prediction:
    """One task's answer to one chunk or image. Only the fields of its kind are set."""

    kind: str  # "count" | "detect" | "label" | "yes_no" | "text"
    text: str = ""  # the generated text ("" in head mode)
    source: str = "text"  # "head": from a task head; "text": parsed from generated text
    count: int | None = None
    label: str | None = None
    boxes: list[Box] = field(default_factory=list)
    parsed: bool = False  # the answer could be read (a text without a number is no count)

    def value(self) -> Any:
        return {"count": self.count, "label": self.label, "yes_no": self.label, "detect": self.boxes,
                "text": self.text}[self.kind]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["boxes"] = [[round(v, 2) for v in b] for b in self.boxes]
        return d


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def parse_count(text: str) -> int | None:
    """The first count in a text: digits ("3", "There are 3 cars") or a number word ("three");
    "no" / "none" / "zero" mean 0. None when the text holds no count."""
    found = _INT.search(text)
    for w in _words(text[:found.start()] if found else text):
        if w in NUMBER_WORDS:
            return NUMBER_WORDS[w]
        if w in ("no", "none", "nothing", "nobody"):
            return 0
    return int(found.group(1)) if found else None


def parse_yes_no(text: str) -> str | None:
    for w in _words(text):
        if w in ("yes", "yeah", "true", "correct"):
            return "yes"
        if w in ("no", "not", "false", "none"):
            return "no"
    return None


def parse_label(text: str, labels: Sequence[str]) -> str | None:
    """The label of `labels` that the text names first (whole words, any case), or None."""
    lowered = text.lower()
    best: tuple[int, str] | None = None
    for label in labels:
        m = re.search(r"(?<![a-z])" + re.escape(label.lower()) + r"(?![a-z])", lowered)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), label)
    return None if best is None else best[1]


def _to_pixels(values: list[float], scale: str, width: int, height: int) -> Box:
    x1, y1, x2, y2 = values
    if scale == "unit":
        x1, x2, y1, y2 = x1 * width, x2 * width, y1 * height, y2 * height
    elif scale == "percent":
        x1, x2, y1, y2 = x1 * width / 100, x2 * width / 100, y1 * height / 100, y2 * height / 100
    x1, x2 = sorted((min(max(x1, 0.0), width), min(max(x2, 0.0), width)))
    y1, y2 = sorted((min(max(y1, 0.0), height), min(max(y2, 0.0), height)))
    return (x1, y1, x2, y2)


def parse_boxes(text: str, width: int, height: int, scale: str = "auto",
                native_size: tuple[int, int] | None = None) -> list[Box]:
    """Every "(x1, y1, x2, y2)" and native "(x1,y1),(x2,y2)" box in the text, in the order written,
    as pixel boxes of a width x height frame. `scale` is the unit of the first form; native boxes are
    on the 0-1000 grid, or in pixels of `native_size` (width, height) when it is given."""
    if scale not in SCALES:
        raise ValueError(f"box scale must be one of {SCALES}, got {scale!r}")
    found, native = [], [(m.start(), [float(v) for v in m.groups()]) for m in _NATIVE_BOX.finditer(text)]
    for m in _BOX.finditer(text):
        json_box = native_size is not None and _BBOX_2D.search(text, max(0, m.start() - 16), m.start())
        (native if json_box else found).append((m.start(), [float(v) for v in m.groups()]))
    if found and scale == "auto":
        top = max(max(v) for _, v in found)
        scale = "unit" if top <= 1.0 else "percent" if top <= 100 else "pixel"
    boxes = [(at, _to_pixels(v, scale, width, height)) for at, v in found]
    nw, nh = native_size or (NATIVE_GRID, NATIVE_GRID)
    for at, v in native:
        v = [v[0] / nw, v[1] / nh, v[2] / nw, v[3] / nh]
        boxes.append((at, _to_pixels(v, "unit", width, height)))
    return [b for _, b in sorted(boxes, key=lambda item: item[0])]


def from_head(kind: str, head: dict[str, Any], width: int, height: int) -> Prediction:
    """A task head's output dict (serve's `HeadResult.to_dict()`) as a Prediction."""
    pred = Prediction(kind, source="head")
    if kind == "count" and head.get("count") is not None:
        pred.count, pred.parsed = int(head["count"]), True
    elif kind == "detect" and head.get("boxes") is not None:
        pred.boxes = [_to_pixels([float(v) for v in b], "unit", width, height) for b in head["boxes"]]
        pred.parsed = True
    elif kind in ("label", "yes_no"):
        value = head.get("label") if kind == "label" else head.get("answer")
        pred.label, pred.parsed = value, value is not None
    return pred


def from_text(kind: str, text: str, width: int, height: int, labels: Sequence[str] = (),
              box_scale: str = "auto", native_size: tuple[int, int] | None = None) -> Prediction:
    """Generated text parsed as an answer of `kind` (`native_size`: see parse_boxes)."""
    pred = Prediction(kind, text=text, source="text")
    if kind == "count":
        pred.count = parse_count(text)
        pred.parsed = pred.count is not None
    elif kind == "detect":
        pred.boxes = parse_boxes(text, width, height, box_scale, native_size)
        # "none" / "no cars" is a real answer: nothing found
        pred.parsed = bool(pred.boxes) or parse_count(text) == 0
    elif kind == "label":
        pred.label = parse_label(text, labels)
        pred.parsed = pred.label is not None
    elif kind == "yes_no":
        pred.label = parse_yes_no(text)
        pred.parsed = pred.label is not None
    else:
        pred.parsed = bool(text.strip())
    return pred


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two (x1, y1, x2, y2) boxes; 0 when both are empty."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def match_boxes(pred: Sequence[Sequence[float]], truth: Sequence[Sequence[float]],
                threshold: float = 0.5) -> tuple[int, int, int]:
    """(true positives, false positives, false negatives) of one frame's boxes."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"IoU threshold must be in (0, 1], got {threshold!r}")
    pairs = sorted(((iou(p, t), i, j) for i, p in enumerate(pred) for j, t in enumerate(truth)), reverse=True)
    used_p, used_t = set(), set()
    for value, i, j in pairs:
        if value < threshold:
            break
        if i not in used_p and j not in used_t:
            used_p.add(i)
            used_t.add(j)
    tp = len(used_p)
    return tp, len(pred) - tp, len(truth) - tp


def f1(tp: int, fp: int, fn: int) -> float:
    """2TP / (2TP + FP + FN); 1.0 when there was nothing to find and nothing was found."""
    denominator = 2 * tp + fp + fn
    return 1.0 if denominator == 0 else 2 * tp / denominator
