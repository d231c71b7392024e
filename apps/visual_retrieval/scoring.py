"""Scores of retrieval answers against known ones.

    exact   the normalised generated text equals an accepted answer (case, spacing and final
            punctuation do not count, as in heads.metrics.exact_match)
    vqa     VQA accuracy of the short answer read off the text (a count, yes / no, a colour,
            a direction; the text itself for open questions), after the VQA normalisation
            (lower case, punctuation and articles dropped, number words as digits): with 3 or
            more reference answers min(1, matches / 3) averaged over leave-one-out subsets, the
            official formula; with fewer, 1 when any reference matches
    iou     grounding: IoU of the first predicted box with the true box; correct at >= 0.5
    token_f1  captions: F1 of the bags of normalised words
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Sequence

from world import COLORS, DIRECTIONS

from apps.common.answers import NUMBER_WORDS, Prediction, from_head, from_text, iou

ARTICLES = {"a", "an", "the"}
# query kind -> Prediction kind and the labels a label answer is drawn from
ANSWER_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ground": ("detect", ()), "count": ("count", ()), "exists": ("yes_no", ()),
    "color": ("label", tuple(COLORS)), "direction": ("label", DIRECTIONS),
    "classify": ("label", ()),  # the labels are the routed domain's (Route.labels)
    "caption": ("text", ()), "qa": ("text", ()),
}
IOU_THRESHOLD = 0.5


def normalise(text: str) -> str:
    return re.sub(r"\s+", " ", str(text).strip().lower()).rstrip(".!?").strip()


def vqa_normalise(text: str) -> str:
    text = re.sub(r"(?<!\d)[.,](?!\d)|[;:!?\"'()\[\]/\\-]", " ", str(text).lower())
    words = [str(NUMBER_WORDS.get(w, w)) for w in text.split() if w not in ARTICLES]
    return " ".join(words)


def exact_match(text: str, answers: Sequence[str]) -> float:
    return float(any(normalise(text) == normalise(a) for a in answers))


def vqa_score(answer: str, answers: Sequence[str]) -> float:
    pred, refs = vqa_normalise(answer), [vqa_normalise(a) for a in answers]
    if len(refs) < 3:
        return float(pred in refs)
    scores = []
    for i in range(len(refs)):  # leave each reference out once, as the official evaluation does
        others = refs[:i] + refs[i + 1:]
        scores.append(min(1.0, sum(r == pred for r in others) / 3))
    return sum(scores) / len(scores)


def token_f1(text: str, reference: str) -> float:
    a, b = Counter(vqa_normalise(text).split()), Counter(vqa_normalise(reference).split())
    common = sum((a & b).values())
    if not a and not b:
        return 1.0
    if not common:
        return 0.0
    precision, recall = common / sum(a.values()), common / sum(b.values())
    return 2 * precision * recall / (precision + recall)


def predict(kind: str, final: dict[str, Any], width: int, height: int, box_scale: str = "auto",
            native_size: tuple[int, int] | None = None, labels: tuple[str, ...] = ()) -> Prediction:
    """The server's final event as the Prediction a query of `kind` expects, boxes in pixels of the
    width x height frame sent (`native_size`: see apps.common.answers.parse_boxes); text labels are
    read against `labels` (the routed domain's) when given, else the kind's own."""
    answer_kind, own = ANSWER_KINDS[kind]
    labels = tuple(labels) or own
    if final.get("head") is not None:
        return from_head(answer_kind, final["head"], width, height)
    return from_text(answer_kind, final.get("text", ""), width, height, labels, box_scale, native_size)


def short_answer(pred: Prediction) -> str | None:
    """The answer a VQA reference is compared with: "2", "yes", "red", ... or the text."""
    if pred.kind == "count":
        return None if pred.count is None else str(pred.count)
    if pred.kind in ("label", "yes_no"):
        return pred.label
    if pred.kind == "detect":
        return None
    return pred.text


def score(query, pred: Prediction) -> dict[str, Any]:
    """The scores that apply to a query with known answers (an empty dict when none are known)."""
    out: dict[str, Any] = {}
    if query.answers:
        out["exact"] = exact_match(pred.text, query.answers) if pred.source == "text" else \
            float(short_answer(pred) is not None and exact_match(short_answer(pred), query.answers))
        short = short_answer(pred)
        out["vqa"] = 0.0 if short is None else vqa_score(short, query.answers)
        if query.kind == "caption":
            out["token_f1"] = round(max(token_f1(pred.text, a) for a in query.answers), 4)
    if query.box is not None:
        value = iou(pred.boxes[0], query.box) if pred.boxes else 0.0
        out["iou"] = round(value, 4)
        out["correct"] = value >= IOU_THRESHOLD
    elif "vqa" in out:
        out["correct"] = out["vqa"] >= 1.0
    return out
