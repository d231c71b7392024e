"""Which eval items a trained binary (exists) head gets wrong, against the world's truth: the size
of the class's largest instance in each item and how much of it other objects cover. Answers
whether a domain's ceiling is the model's view of small or hidden objects, or its training.

    python -m bench.binary_misses --adapter $VLORA_HOME/adapters/fused/fused_0 --domain exists_bus

Reads the base model, the domain's dataset and its world from the adapter's meta.json (a
world-distilled domain).
An experiment, printed; nothing passes or fails.

With --thresholds it also scores the head's logit at three thresholds: 0 (what it answers), the
one with the best accuracy on the train split (a calibration that could be shipped), and the best
on the eval split itself (an upper bound no calibration reaches). Answers whether a domain below
its requirement is a threshold away from it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from bench.adapter_probe import adapter_on_base
from train.data import load_domain
from train.evaluate import head_outputs
from world.io import load_world


def threshold_accuracies(train_scores, train_labels, eval_scores, eval_labels) -> dict:
    """Accuracy of "yes when the score is above t" at t = 0, at the train split's best t and at
    the eval split's best t (ties: the lowest). Labels are 0 / 1."""
    def acc(scores, labels, t):
        return float(((np.asarray(scores) > t) == (np.asarray(labels) == 1)).mean())

    def best(scores, labels):
        candidates = np.unique(np.concatenate([np.asarray(scores, float), [0.0]]))
        return max(candidates, key=lambda t: (acc(scores, labels, t), -t))

    t_train, t_eval = best(train_scores, train_labels), best(eval_scores, eval_labels)
    return dict(train_at_0=acc(train_scores, train_labels, 0.0), eval_at_0=acc(eval_scores, eval_labels, 0.0),
                train_threshold=float(t_train), train_at_train_threshold=acc(train_scores, train_labels, t_train),
                eval_at_train_threshold=acc(eval_scores, eval_labels, t_train),
                eval_threshold=float(t_eval), eval_at_eval_threshold=acc(eval_scores, eval_labels, t_eval))


def _scores(vlm, head, domain, split: str) -> tuple[list[float], list[int]]:
    scores, labels = [], []
    for outputs, targets in head_outputs(vlm, head, domain, split, domain.size(split), 32):
        scores += outputs["logits"].float().reshape(-1).tolist()
        labels += [1 if t == "yes" else 0 for t in targets]
    return scores, labels


def _area(box) -> int:
    x1, y1, x2, y2 = box
    return max(0, x2 - x1) * max(0, y2 - y1)


def _covered(box, others) -> float:
    """Share of `box` under the union of `others` (objects drawn later may hide it; an upper bound)."""
    x1, y1, x2, y2 = box
    if x2 <= x1 or y2 <= y1:
        return 0.0
    mask = np.zeros((y2 - y1, x2 - x1), bool)
    for ox1, oy1, ox2, oy2 in others:
        mask[max(oy1, y1) - y1:max(min(oy2, y2) - y1, 0), max(ox1, x1) - x1:max(min(ox2, x2) - x1, 0)] = True
    return float(mask.mean())


def item_view(truth, cls: str) -> tuple[int, float]:
    """(pixels of the class's largest instance, the share of it other objects overlap); (0, 0) if absent."""
    objs = truth.objects
    mine = [o for o in objs if o.cls == cls]
    if not mine:
        return 0, 0.0
    big = max(mine, key=lambda o: _area(o.box))
    return _area(big.box), _covered(big.box, [o.box for o in objs if o is not big])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--domain", required=True)
    ap.add_argument("--model", default=None, help="the base checkpoint (default: the one meta.json records)")
    ap.add_argument("--out", default=None, help="per-item rows as JSON lines")
    ap.add_argument("--thresholds", action="store_true", help="accuracy at the train- and eval-best thresholds too")
    args = ap.parse_args()

    vlm, state = adapter_on_base(args.adapter, args.model)
    rec = state.domains[args.domain]
    domain = load_domain(rec["dataset"])
    if domain.info.task != "binary":
        raise SystemExit(f"domain {args.domain!r} is a {domain.info.task} domain; this probe reads binary heads")
    record = json.loads((domain.path / "domain.json").read_text())  # the class and world DomainInfo leaves out
    cls = record["classes"][0]
    truth = {f"{it.kind}-{it.index:06d}": it.truth for it in load_world(record["source"]["dir"]).items}

    head = state.heads[args.domain].build(vlm.device)
    head.eval()  # as train.evaluate scores it: no head dropout
    n = domain.size("eval")
    targets, preds = [], []
    for outputs, batch_targets in head_outputs(vlm, head, domain, "eval", n, 32):
        preds += [r.answer for r in head.decode(outputs)]
        targets += batch_targets
    items = []
    for pid, pred, target in zip(domain.splits["eval"]["id"][:n], preds, targets):
        area, covered = item_view(truth[pid], cls)
        items.append({"id": pid, "target": target, "pred": pred, "area": area, "covered": round(covered, 3)})
    groups = {(present, correct): [it for it in items if (it["area"] > 0) == present
                                   and (it["pred"] == it["target"]) == correct]
              for present in (True, False) for correct in (True, False)}
    print(f"{args.domain}: {sum(it['pred'] == it['target'] for it in items)}/{n} right "
          f"({sum(it['pred'] == it['target'] for it in items) / n:.3f}); {cls} present in "
          f"{sum(it['area'] > 0 for it in items)} items")
    for label, key in (("false negatives", (True, False)), ("true positives", (True, True))):
        if groups[key]:
            areas = np.array([it["area"] for it in groups[key]])
            cov = np.array([it["covered"] for it in groups[key]])
            print(f"  {label}: {len(groups[key])}; largest {cls} {np.median(areas):.0f} px median "
                  f"({np.percentile(areas, 25):.0f}-{np.percentile(areas, 75):.0f}), overlapped "
                  f"{np.median(cov):.2f} median, >= 0.5 overlapped in {int((cov >= 0.5).sum())}")
    print(f"  false positives: {len(groups[False, False])} of "
          f"{len(groups[False, True]) + len(groups[False, False])} items without a {cls}")
    # What else is in the picture: a head that answers from clutter or a look-alike class
    # says "yes" on busy scenes and "no" on sparse ones whatever the class itself shows.
    others = sorted({o.cls for t in truth.values() for o in t.objects} - {cls})
    print(f"  {'group':<16}{'items':>6}{'objects/item':>14}" + "".join(f"{'with ' + c:>14}" for c in others))
    for label, key in (("true positives", (True, True)), ("false negatives", (True, False)),
                       ("true negatives", (False, True)), ("false positives", (False, False))):
        if not groups[key]:
            continue
        objs = [truth[it["id"]].objects for it in groups[key]]
        share = {c: np.mean([any(o.cls == c for o in ob) for ob in objs]) for c in others}
        print(f"  {label:<16}{len(objs):>6}{np.mean([len(ob) for ob in objs]):>14.2f}"
              + "".join(f"{share[c]:>14.2f}" for c in others))
    if args.thresholds:
        r = threshold_accuracies(*_scores(vlm, head, domain, "train"), *_scores(vlm, head, domain, "eval"))
        print(f"  thresholds: at 0 train {r['train_at_0']:.3f}, eval {r['eval_at_0']:.3f}; at the train split's "
              f"best ({r['train_threshold']:.3f}) train {r['train_at_train_threshold']:.3f}, eval "
              f"{r['eval_at_train_threshold']:.3f}; at the eval split's own best ({r['eval_threshold']:.3f}) "
              f"eval {r['eval_at_eval_threshold']:.3f}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(it) + "\n" for it in items))


if __name__ == "__main__":
    main()
