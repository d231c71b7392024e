"""The majority baseline of a domain: what always answering the most common TRAINING label
scores on the eval items, and whether an adapter beats it by more than chance.

An adapter that answers the same count on every chunk scores exactly the share of the most
common label, which can look like knowledge next to a requirement. So every share-of-items
score (classify, count, binary, lm exact match) is compared with that baseline on the same
items, paired: on the items where exactly one of them is right, the adapter must win more
often than a fair coin would (an exact one-sided sign test, McNemar's exact test, at
`ALPHA`). A point comparison would call 0.45 against 0.44 "better"; the test does not, and a
handful of eval items never shows an adapter better. Detect scores F1, no share of items: no
baseline here.

    verdict = domain_baseline(domain, preds, targets)           # or compare_to_majority(task, ...)
    verdict["better"]   # False: "no better than always answering 2"
    baseline_line("count_people", metrics)   # the one-line flag for reports, "" when it beats it

The same sign test puts an adapter beside the base model answering zero-shot (train/zero_shot.py,
metrics["baselines"]["zero_shot"]); `zero_shot_line` is its flag.
"""

from __future__ import annotations

from collections import Counter
from math import comb
from typing import Any, Callable, Sequence

from heads import exact_match

BASELINE_TASKS = ("classify", "count", "binary", "lm")
ALPHA = 0.05  # one-sided: the adapter must beat the baseline at the 95% level
ANSWER_COLUMN = {"classify": "label", "binary": "label", "count": "count", "lm": "answer"}


def majority(labels: Sequence) -> Any:
    """The most common of `labels`; a tie goes to the smallest (by its text), so the baseline does
    not depend on the order of the training rows."""
    if len(labels) == 0:
        raise ValueError("a majority baseline needs training labels, got none")
    counts = Counter(labels)
    top = max(counts.values())
    return min((label for label, c in counts.items() if c == top), key=str)


def sign_test_p(wins: int, losses: int) -> float:
    """P(X >= wins) for X ~ Binomial(wins + losses, 1/2): how likely an adapter no better than the
    baseline wins at least `wins` of the items where exactly one of the two is right. 1.0 when
    there is no such item (nothing tells them apart)."""
    if wins < 0 or losses < 0:
        raise ValueError(f"wins and losses count items, got {wins} and {losses}")
    n = wins + losses
    return sum(comb(n, k) for k in range(wins, n + 1)) / 2 ** n


def _same(task: str) -> Callable[[Any, Any], bool]:
    if task == "lm":  # generated text: the exact-match metric's normalisation (case, final stop)
        return lambda a, b: exact_match(str(a), str(b)) == 1.0
    return lambda a, b: a == b


def compare_to_majority(task: str, preds: Sequence, targets: Sequence, train_labels: Sequence,
                        alpha: float = ALPHA) -> dict:
    """The majority baseline of one evaluation: {"answer": X, "accuracy": share of `targets` equal
    to X, "n", "wins"/"losses": items only the adapter / only X gets right, "p_value", "alpha",
    "better": the adapter beats X by the paired test}."""
    if task not in BASELINE_TASKS:
        raise ValueError(f"task {task!r} has no majority baseline; tasks with one: {list(BASELINE_TASKS)}")
    if len(preds) != len(targets) or not targets:
        raise ValueError(f"a baseline needs paired predictions and targets, got {len(preds)} and {len(targets)}")
    answer = majority(list(train_labels))
    base_right = item_scores(task, [answer] * len(targets), targets)
    return {"answer": answer, "accuracy": sum(base_right) / len(targets),
            **paired_verdict(item_scores(task, preds, targets), base_right, alpha)}


def item_scores(task: str, preds: Sequence, targets: Sequence) -> list[float]:
    """Each item's score: 1.0 / 0.0 for a right / wrong answer, or for detect the item's own F1 at
    IoU 0.5 (its boxes against its targets), so two answerers compare item by item on any task."""
    if task == "detect":
        from heads import f1_at_iou

        return [float(f1_at_iou([p], [t], 0.5)) for p, t in zip(preds, targets)]
    same = _same(task)
    return [1.0 if p is not None and same(p, t) else 0.0 for p, t in zip(preds, targets)]  # None: no answer read


def paired_verdict(adapter_scores: Sequence[float], base_scores: Sequence[float], alpha: float = ALPHA) -> dict:
    """The sign test of an adapter against a baseline on the same items: {"n", "wins" (items where
    the adapter scores higher), "losses" (lower), "p_value", "alpha", "better"}; ties tell nothing."""
    if len(adapter_scores) != len(base_scores) or not base_scores:
        raise ValueError(f"a paired test needs scores of the same items, got {len(adapter_scores)} and {len(base_scores)}")
    wins = sum(a > b for a, b in zip(adapter_scores, base_scores))
    losses = sum(b > a for a, b in zip(adapter_scores, base_scores))
    p = sign_test_p(wins, losses)
    return {"n": len(base_scores), "wins": wins, "losses": losses, "p_value": p, "alpha": alpha, "better": p < alpha}


def training_answers(domain) -> list:
    """The answers a domain's train split teaches (its head targets), read without its pictures."""
    task = domain.info.task
    values = list(domain.splits["train"][ANSWER_COLUMN[task]])
    return [int(v) for v in values] if task == "count" else values


def domain_baseline(domain, preds: Sequence, targets: Sequence) -> dict | None:
    """`compare_to_majority` of predictions on a domain's items against its train split's majority
    answer; None for a task whose score is no share of items (detect)."""
    task = domain.info.task
    return compare_to_majority(task, preds, targets, training_answers(domain)) if task in BASELINE_TASKS else None


def _answer(verdict: dict) -> str:
    return repr(verdict["answer"]) if isinstance(verdict["answer"], str) else str(verdict["answer"])


def baseline_cell(verdict: dict | None) -> str | None:
    """"always 'no' 0.438" for a table cell; None without a baseline."""
    return None if verdict is None else f"always {_answer(verdict)} {verdict['accuracy']:.3f}"


def beats_cell(verdict: dict | None) -> str | None:
    """"yes (p=0.001)" or "NO (p=1.00)" for a table cell; None without a baseline."""
    if verdict is None:
        return None
    return f"{'yes' if verdict['better'] else 'NO'} (p={verdict['p_value']:.3g})"


def baseline_note(metrics: dict) -> str:
    """" against always 2 0.438: NO BETTER (p=1); zero-shot 0.312: better (p=0.002)" for a log line
    after a score; each part only where its baseline was taken (evaluations before zero-shot
    baselines carry no "baselines")."""
    verdict, note = metrics.get("baseline"), ""
    if verdict:
        note = (f" against {baseline_cell(verdict)}: {'better' if verdict['better'] else 'NO BETTER'} "
                f"(p={verdict['p_value']:.3g})")
    if "baselines" in metrics:
        shot = metrics["baselines"].get("zero_shot")
        note += (";" if note else "") + (" zero-shot: not measured" if not shot else
                                         f" zero-shot {shot['accuracy']:.3f}: {'better' if shot['better'] else 'NO BETTER'}"
                                         f" (p={shot['p_value']:.3g})")
    return note


def zero_shot_cell(metrics: dict) -> str:
    """"0.312" (the base model's zero-shot score on the same items) or "not measured", for a table cell."""
    shot = (metrics.get("baselines") or {}).get("zero_shot")
    return "not measured" if not shot else f"{shot['accuracy']:.3f}"


def teacher_cell(metrics: dict) -> str:
    """The teacher's agreement with the truth, "0.953", or "-" where the data records no truth."""
    value = (metrics.get("baselines") or {}).get("teacher_vs_truth")
    return "-" if value is None else f"{value:.3f}"


def zero_shot_text(verdict: dict) -> str:
    """Why an adapter counts as no better than its base model answering alone, in words."""
    unread = f", {verdict['unparsed']} of its answers unreadable" if verdict.get("unparsed") else ""
    return (f"no better than the base model answering zero-shot ({verdict['accuracy']:.3f} on {verdict['n']} eval "
            f"items{unread}; it wins {verdict['wins']} and loses {verdict['losses']} of the items where the two "
            f"differ, one-sided sign test p={verdict['p_value']:.3g} >= {verdict['alpha']})")


def zero_shot_line(name: str, metrics: dict) -> str:
    """The one-line flag of an adapter no better than its base model zero-shot; "" when it beats it
    or the zero-shot answers were not measured."""
    shot = (metrics.get("baselines") or {}).get("zero_shot")
    if not shot or shot["better"]:
        return ""
    return f"NO BETTER THAN ZERO-SHOT: {name} {metrics['metric']} {metrics['accuracy']:.3f} is {zero_shot_text(shot)}"


def no_better_text(verdict: dict) -> str:
    """Why an adapter counts as no better than its baseline, in words."""
    return (f"no better than always answering {_answer(verdict)} ({verdict['accuracy']:.3f} on {verdict['n']} eval "
            f"items; it wins {verdict['wins']} and loses {verdict['losses']} of the items only one gets right, "
            f"one-sided sign test p={verdict['p_value']:.3g} >= {verdict['alpha']})")


def baseline_line(name: str, metrics: dict) -> str:
    """The one-line flag of an adapter no better than its majority baseline; "" when it beats it or
    its task has none."""
    verdict = metrics.get("baseline")
    if not verdict or verdict["better"]:
        return ""
    return f"NO BETTER THAN MAJORITY: {name} {metrics['metric']} {metrics['accuracy']:.3f} is {no_better_text(verdict)}"
