"""The zero-shot baseline of a domain: what the base model, with no adapter, scores on the same
eval items by writing its answer through the LM head, the text read as served answers are read.

An adapter is worth serving only where it knows more than the model it sits on; a base that
already answers "is there a bus?" as well as the adapter makes the adapter a cost. So every
evaluation can put the adapter beside the base, item by item, with the majority baseline's sign
test (train/baselines.py): `better` only where the adapter wins clearly more of the items the two
disagree on.

The base's generated texts are cached per (base checkpoint fingerprint, eval split fingerprint,
decoding length) in `<dataset>/zero_shot/`, so fusion's many evaluations of a domain, the
offline report and a later `vlora train` generate them once. The texts are parsed on every read
by `parse(info, text) -> answer` (the head's target form: a count, "yes"/"no", a label, unit
boxes, or the text for lm), which the caller gives: the serving side's parser lives above this
floor (apps/common/answers.py), and parsing again keeps the cache right when the parser changes.

    zero_shot = ZeroShot(parse)                     # one per process: it memoises the texts
    record = zero_shot.record(vlm, domain)          # {"accuracy", "n", "unparsed", "scores", ...}
    verdict = compare_to_zero_shot(task, preds, targets, record)   # {"accuracy", "better", "p_value", ...}
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from .baselines import ALPHA, item_scores, paired_verdict

CACHE_DIR = "zero_shot"  # beside the dataset's splits
# The base is given room for the teacher's longest answer, and at least for a sentence: a base that
# answers "There are 3 cars." must not be cut off before its number (the apps let it write 32).
MIN_NEW_TOKENS, MAX_NEW_TOKENS = 12, 48

Parse = Callable[[Any, str], Any]  # (DomainInfo, generated text) -> the answer as the head's target, None: unreadable


class ZeroShot:
    """The base model's answers on domains' eval items, generated once per (base, eval split) and
    kept in memory and beside each dataset. `max_new_tokens`: None sizes it per domain from the
    longest eval answer (+ its end token), within [MIN_NEW_TOKENS, MAX_NEW_TOKENS]; decoding stops
    where every answer has ended."""

    def __init__(self, parse: Parse, max_new_tokens: int | None = None, batch_size: int = 16, log=None):
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or int(max_new_tokens) < 1):
            raise ValueError(f"zero-shot max_new_tokens={max_new_tokens!r}: must be an int >= 1 or None")
        self.parse, self.max_new_tokens, self.batch_size = parse, max_new_tokens, batch_size
        self.log = log or sys.stderr
        self._records: dict[str, dict] = {}  # parsed records: fusion evaluates a domain many times
        self._base: dict[str, str] = {}  # checkpoint path -> weights fingerprint

    def record(self, vlm, domain) -> dict:
        """{"accuracy": the base's score (its task's metric), "n", "unparsed": texts the parser could
        not read, "read", "scores" and "answers" (parsed) per item, "texts", "max_new_tokens", "base"}."""
        from heads import f1_at_iou

        from .data import head_target

        split = domain.splits["eval"]
        if len(split) == 0:
            raise ValueError(f"domain {domain.info.name!r}: the eval split is empty; no zero-shot baseline")
        tokens = self.max_new_tokens or answer_budget(vlm, split["answer"])
        key, base = self._key(vlm, domain.info.name, split, tokens)
        memo = f"{key}/{domain.info.task}"  # the same texts read for another task (a head domain's lm view)
        if memo in self._records:
            return self._records[memo]
        cache = Path(domain.path) / CACHE_DIR / f"{key}.json"
        texts = _read(cache)
        if texts is None or len(texts) != len(split):
            texts = base_answers(vlm, domain, tokens, self.batch_size)
            _write(cache, {"base": base, "eval_fingerprint": _eval_fingerprint(split), "max_new_tokens": tokens,
                           "texts": texts}, self.log)
        info = domain.info
        parsed = [self.parse(info, t) for t in texts]
        targets = [head_target(info, r) if info.task != "lm" else r["answer"] for r in _rows(split)]
        answers = [([] if a is None else a) if info.task == "detect" else a for a in parsed]
        scores = item_scores(info.task, answers, targets)
        accuracy = f1_at_iou(answers, targets, 0.5) if info.task == "detect" else sum(scores) / len(scores)
        self._records[memo] = {
            "accuracy": float(accuracy), "n": len(texts), "unparsed": sum(a is None for a in parsed),
            "read": [a is not None for a in parsed], "scores": scores, "answers": answers, "targets": targets,
            "texts": texts, "max_new_tokens": tokens, "base": base}
        return self._records[memo]

    def _key(self, vlm, name: str, split, tokens: int) -> tuple[str, str]:
        from adapters.base import fingerprint

        path = str(vlm.ref.path)
        if path not in self._base:
            self._base[path] = fingerprint(path) or f"path:{Path(path).resolve()}"
        base = self._base[path]
        raw = json.dumps([base, name, _eval_fingerprint(split), len(split), tokens])
        return hashlib.sha256(raw.encode()).hexdigest()[:20], base


def compare_to_zero_shot(task: str, preds: Sequence, targets: Sequence, record: dict, alpha: float = ALPHA) -> dict:
    """The zero-shot verdict of an evaluation of the first len(preds) eval items: {"accuracy": the
    base's score on them, "unparsed", "n", "wins", "losses", "p_value", "alpha", "better"}."""
    n = len(preds)
    if n > record["n"] or len(targets) != n:
        raise ValueError(f"a zero-shot verdict needs {n} paired targets within the base's {record['n']} answers, "
                         f"got {len(targets)} targets")
    base = record["answers"][:n]
    return {"accuracy": first_items_score(task, record, n), "unparsed": n - sum(record["read"][:n]),
            **paired_verdict(item_scores(task, preds, targets), item_scores(task, base, targets), alpha)}


def first_items_score(task: str, record: dict, n: int) -> float:
    """The base's score on the first `n` eval items (all of them: the record's own)."""
    if n >= record["n"]:
        return record["accuracy"]
    if task == "detect":  # F1 pools the items' boxes: no mean of per-item scores
        from heads import f1_at_iou

        return float(f1_at_iou(record["answers"][:n], record["targets"][:n], 0.5))
    return sum(record["scores"][:n]) / n


def base_answers(vlm, domain, max_new_tokens: int, batch_size: int = 16) -> list[str]:
    """The base model's greedy answers to every eval item, the LoRA switched off (not reset: the
    adapter being trained or evaluated keeps its weights)."""
    from .evaluate import greedy_decode

    split = domain.splits["eval"]
    texts: list[str] = []
    with vlm.model.disable_adapter():
        for start in range(0, len(split), batch_size):
            rows = domain.rows("eval", range(start, min(len(split), start + batch_size)), vlm.encoder)
            texts += greedy_decode(vlm, vlm.encoder.encode_many(rows, domain.info), max_new_tokens)
    return texts


def answer_budget(vlm, answers: Sequence[str]) -> int:
    """Tokens enough for the longest teacher answer and its end token, within [MIN_NEW_TOKENS, MAX_NEW_TOKENS]."""
    tok = vlm.processor.tokenizer
    longest = max((len(tok(str(a), add_special_tokens=False)["input_ids"]) for a in answers), default=1)
    return max(MIN_NEW_TOKENS, min(MAX_NEW_TOKENS, longest + 1))


def _rows(split) -> list[dict]:
    """The eval rows without their pictures (targets only)."""
    return split.remove_columns([c for c in ("image",) if c in split.column_names]).to_list()


def _eval_fingerprint(split) -> str:
    # `datasets` keeps a fingerprint of a split's content and of every transform made to it
    return str(getattr(split, "_fingerprint", None) or f"rows:{len(split)}")


def _read(path: Path) -> list[str] | None:
    """The cached texts, or None where there are none or the file is damaged (they are generated again)."""
    try:
        texts = json.loads(path.read_text()).get("texts") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return texts if isinstance(texts, list) and all(isinstance(t, str) for t in texts) else None


def _write(path: Path, record: dict, log) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # one per process: every rank of a run may write
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    except OSError as e:  # a read-only dataset: the answers stay memoised in this process only
        print(f"[zero-shot] not cached ({e})", file=log, flush=True)
