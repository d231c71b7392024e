"""Where a free-form (lm) domain's exact match is lost: the eval items scored by the kind of
question (its first two words: "how many", "is there", "what color", ...), with what the adapter
answers instead. Answers whether a qa domain below its requirement misses everywhere or on one
kind of question, and whether its counts miss by one or at random.

    python -m bench.qa_misses --adapter $VLORA_HOME/adapters/fused/fused_0 --domain qa

Greedy-decodes the eval split as `train.evaluate` does, on the base the adapter's meta.json
records. An experiment, printed; nothing passes or fails.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from bench.adapter_probe import adapter_on_base
from heads.metrics import exact_match
from train.data import load_domain
from train.evaluate import batches, greedy_decode


def question_kind(question: str) -> str:
    """The question's first two words, lower case, punctuation dropped: its kind in any qa domain
    whose questions open the same way per kind (the world's do)."""
    words = "".join(c if c.isalnum() or c.isspace() else " " for c in question.lower()).split()
    return " ".join(words[:2]) or "(empty)"


def _number(text: str) -> int | None:
    text = text.strip().rstrip(".")
    return int(text) if text.isdigit() else None


def by_kind(rows: list[dict]) -> dict[str, dict]:
    """Per kind of question (rows: question, target, pred): items, exact match, the commonest wrong
    (target -> answer) pairs and, where both are numbers, the mean signed and absolute error."""
    out = {}
    for kind in sorted({question_kind(r["question"]) for r in rows}):
        mine = [r for r in rows if question_kind(r["question"]) == kind]
        wrong = [r for r in mine if not exact_match(r["pred"], r["target"])]
        nums = [(_number(r["pred"]), _number(r["target"])) for r in mine]
        nums = [(p, t) for p, t in nums if p is not None and t is not None]
        out[kind] = {"items": len(mine), "exact": exact_match([r["pred"] for r in mine], [r["target"] for r in mine]),
                     "wrong": Counter(f"{r['target']} -> {r['pred']}" for r in wrong).most_common(5)}
        if nums and len(nums) == len(mine):  # a counting kind: how far off, and which way
            out[kind]["mean_error"] = sum(p - t for p, t in nums) / len(nums)
            out[kind]["mean_abs_error"] = sum(abs(p - t) for p, t in nums) / len(nums)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--domain", default="qa")
    ap.add_argument("--model", default=None, help="the base checkpoint (default: the one meta.json records)")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="as train.evaluate decodes")
    ap.add_argument("--out", default=None, help="per-item rows as JSON lines")
    ap.add_argument("--base", action="store_true", help="the base's answers: the adapter's LoRA left out")
    args = ap.parse_args()

    vlm, state = adapter_on_base(args.adapter, args.model, lora=not args.base)
    domain = load_domain(state.domains[args.domain]["dataset"])
    if domain.info.task != "lm":
        raise SystemExit(f"domain {args.domain!r} is a {domain.info.task} domain; this probe reads lm answers")
    rows = []
    for chunk, items in batches(vlm, domain, "eval", domain.size("eval"), 32):
        for r, pred in zip(chunk, greedy_decode(vlm, items, args.max_new_tokens)):
            rows.append({"id": r["id"], "question": r["question"], "target": r["answer"], "pred": pred})
    total = exact_match([r["pred"] for r in rows], [r["target"] for r in rows])
    print(f"{args.domain} on {args.adapter}{' (its base alone)' if args.base else ''}: exact match {total:.3f} over {len(rows)} eval items")
    print(f"  {'kind':<14}{'items':>6}{'exact':>7}{'lost':>7}  mean error / |error|   commonest misses (truth -> answer)")
    for kind, k in sorted(by_kind(rows).items(), key=lambda kv: -kv[1]["items"]):
        lost = k["items"] * (1 - k["exact"]) / len(rows)  # points of the total this kind costs
        err = (f"{k['mean_error']:+.2f} / {k['mean_abs_error']:.2f}" if "mean_error" in k else "-").ljust(20)
        print(f"  {kind:<14}{k['items']:>6}{k['exact']:>7.3f}{lost:>7.3f}  {err}  "
              + ", ".join(f"{pair} x{n}" for pair, n in k["wrong"]))
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
