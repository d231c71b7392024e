"""Per-domain evaluation with the standard metric of each task type.

    classify, count, binary: top-1 accuracy of the head's answer
    detect:                  F1 at IoU 0.5 of the head's boxes (heads.f1_at_iou)
    lm:                      exact match of the greedy-decoded answer (heads.exact_match)

The result's "accuracy" is that number whatever the task, so fusion compares one score per domain
against its requirement. A detect head whose score threshold was calibrated (train/calibrate.py)
is also scored at the default threshold, "f1_at_0.5", from the same forward pass, which shows
what the calibration bought.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from torch import Tensor

from heads import TaskHead, accuracy, exact_match, f1_at_iou
from heads.config import DEFAULT_SCORE_THRESHOLD

from .baselines import domain_baseline
from .data import DomainData, Encoded, batch_token_xy, collate, head_target
from .model import language_forward, lm_head_of

METRICS = {"classify": "top1", "count": "top1", "binary": "top1", "detect": "f1@0.5", "lm": "exact_match"}


def hidden_states(vlm, items: list[Encoded]) -> tuple[Tensor, Tensor]:
    """Final hidden states [B, T, D] and attention mask [B, T] of a batch, no gradients."""
    batch = collate(items, vlm.encoder.pad_id)
    with torch.no_grad(), vlm.accelerator.autocast():
        from .model import visual_features

        visual = batch.get("visual")
        if visual is None:
            visual = torch.cat([visual_features(vlm.model, p) for p in batch["pixels"]], dim=0)
        hidden = language_forward(vlm.model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                  visual, batch["visual_mask"])
    return hidden, batch["attention_mask"]


def greedy_decode(vlm, items: list[Encoded], max_new_tokens: int) -> list[str]:
    """Greedy answers of a batch, decoded until each row emits an end-of-turn token.

    No KV cache: every step runs the (short) sequences again, which keeps one code path for
    every architecture and for cached vision features; answers here are a few tokens long.
    """
    tokens: list[list[int]] = [[] for _ in items]
    done = [False] * len(items)
    head = lm_head_of(vlm.model)
    for _ in range(max_new_tokens):
        todo = [i for i, d in enumerate(done) if not d]
        if not todo:
            break
        grown = [items[i].extend(torch.tensor(tokens[i], dtype=torch.long)) for i in todo]
        hidden, mask = hidden_states(vlm, grown)
        last = mask.sum(dim=1) - 1  # [B] position of each row's last real token
        with torch.no_grad():
            logits = head(hidden[torch.arange(len(todo)), last])  # [B, V]
        for i, t in zip(todo, logits.argmax(dim=-1).tolist()):
            if t in vlm.encoder.eos_ids:
                done[i] = True
            else:
                tokens[i].append(t)
    return [vlm.processor.tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens]


def batches(vlm, domain: DomainData, split: str, n: int, batch_size: int) -> Iterator[tuple[list[dict], list[Encoded]]]:
    """The first `n` rows of `split` in batches: (rows, their encoded items)."""
    for start in range(0, n, batch_size):
        chunk = domain.rows(split, range(start, min(n, start + batch_size)), vlm.encoder)
        yield chunk, vlm.encoder.encode_many(chunk, domain.info)


def head_outputs(vlm, head: TaskHead, domain: DomainData, split: str, n: int,
                 batch_size: int) -> Iterator[tuple[dict[str, Tensor], list]]:
    """Per batch of the first `n` rows of `split`: the head's raw outputs (decode them at any
    threshold) and the rows' targets. One forward pass of the model and the head, no gradients."""
    for chunk, items in batches(vlm, domain, split, n, batch_size):
        hidden, mask = hidden_states(vlm, items)
        with torch.no_grad():
            outputs = head(hidden, mask, batch_token_xy(items))
        yield outputs, [head_target(domain.info, r) for r in chunk]


def split_size(domain: DomainData, split: str, limit: int | None, doing: str) -> int:
    """Items of `split` to use (at most `limit`); a clear error when there are none."""
    size = domain.size(split)
    if size == 0:
        raise ValueError(f"domain {domain.info.name!r}: split {split!r} is empty; nothing to {doing}")
    return size if limit is None else min(limit, size)


def evaluate(vlm, head: TaskHead | None, domain: DomainData, split: str = "eval", batch_size: int = 32,
             max_new_tokens: int = 8, limit: int | None = None, zero_shot=None) -> dict:
    """{"accuracy": score, "metric": name, "n": items, "task": type, "baseline": verdict, "baselines":
    {"zero_shot": verdict, "teacher_vs_truth": agreement}} on `split` of `domain`. "baseline"
    compares the score with always answering the most common training label on the same items
    (train/baselines.py; None for detect); "zero_shot" with the base model's own answers to them
    (train/zero_shot.py; None without `zero_shot`, a `ZeroShot`, or off the eval split);
    "teacher_vs_truth" is what domain.json records (None without ground truth). Detect heads at
    another threshold than the default add "f1_at_0.5"."""
    info = domain.info
    n = split_size(domain, split, limit, "evaluate")
    if info.task != "lm" and head is None:
        raise ValueError(f"domain {info.name!r} (task {info.task!r}) needs its head to be evaluated")
    vlm.model.eval()
    if head is not None:
        head.eval()
    preds, targets, extra = [], [], {}
    if info.task == "lm":
        for chunk, items in batches(vlm, domain, split, n, batch_size):
            preds += greedy_decode(vlm, items, max_new_tokens)
            targets += [r["answer"] for r in chunk]
        return {"accuracy": float(exact_match(preds, targets)), "metric": METRICS["lm"], "n": n, "task": "lm",
                "baseline": domain_baseline(domain, preds, targets),
                "baselines": other_baselines(vlm, domain, split, preds, targets, zero_shot)}
    # detect at a calibrated threshold: the same outputs decoded at the default one too
    default = [] if info.task == "detect" and head.config.score_threshold != DEFAULT_SCORE_THRESHOLD else None
    for outputs, batch_targets in head_outputs(vlm, head, domain, split, n, batch_size):
        for result in head.decode(outputs):
            preds.append({"classify": result.label, "count": result.count, "binary": result.answer,
                          "detect": result.boxes}[info.task])
        if default is not None:
            default += [r.boxes for r in head.decode(outputs, threshold=DEFAULT_SCORE_THRESHOLD)]
        targets += batch_targets
    if info.task == "detect":
        score = f1_at_iou(preds, targets, 0.5)
        if default is not None:
            extra["f1_at_0.5"] = float(f1_at_iou(default, targets, 0.5))
    else:
        score = accuracy(preds, targets)
    extra["baseline"] = domain_baseline(domain, preds, targets)
    extra["baselines"] = other_baselines(vlm, domain, split, preds, targets, zero_shot)
    return {"accuracy": float(score), "metric": METRICS[info.task], "n": n, "task": info.task, **extra}


def other_baselines(vlm, domain: DomainData, split: str, preds: list, targets: list, zero_shot=None) -> dict:
    """The baselines beside the majority: the base model's zero-shot verdict on the same items
    (None: not measured) and the teacher's agreement with the truth (None: no ground truth)."""
    from .data import teacher_agreement
    from .zero_shot import compare_to_zero_shot

    verdict = None
    if zero_shot is not None and split == "eval":  # the base's answers are generated for the eval split
        verdict = compare_to_zero_shot(domain.info.task, preds, targets, zero_shot.record(vlm, domain))
    return {"zero_shot": verdict, "teacher_vs_truth": teacher_agreement(domain.path)}


def at_default_note(metrics: dict) -> str:
    """" (at 0.5: 0.612)" for a log line where evaluation also scored the default threshold, else ""."""
    return f" (at {DEFAULT_SCORE_THRESHOLD:g}: {metrics['f1_at_0.5']:.3f})" if "f1_at_0.5" in metrics else ""


def lm_view(data):
    """The same domain, answered by the LM head: targets are the `answer` texts."""
    return dataclasses.replace(data, info=dataclasses.replace(data.info, task="lm"))
