"""Per-domain evaluation with the standard metric of each task type.

    classify, count, binary: top-1 accuracy of the head's answer
    detect:                  F1 at IoU 0.5 of the head's boxes (heads.f1_at_iou)
    lm:                      exact match of the greedy-decoded answer (heads.exact_match)

The result's "accuracy" is that number whatever the task, so fusion compares one score per domain
against its requirement.
"""

from __future__ import annotations

import torch
from torch import Tensor

from heads import TaskHead, accuracy, exact_match, f1_at_iou

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


def evaluate(vlm, head: TaskHead | None, domain: DomainData, split: str = "eval", batch_size: int = 32,
             max_new_tokens: int = 8, limit: int | None = None) -> dict:
    """{"accuracy": score, "metric": name, "n": items, "task": type} on `split` of `domain`."""
    info, size = domain.info, domain.size(split)
    n = size if limit is None else min(limit, size)
    if n == 0:
        raise ValueError(f"domain {info.name!r}: split {split!r} is empty; nothing to evaluate")
    if info.task != "lm" and head is None:
        raise ValueError(f"domain {info.name!r} (task {info.task!r}) needs its head to be evaluated")
    vlm.model.eval()
    if head is not None:
        head.eval()
    preds, targets = [], []
    for start in range(0, n, batch_size):
        chunk = domain.rows(split, range(start, min(n, start + batch_size)), vlm.encoder)
        items = vlm.encoder.encode_many(chunk, info)
        if info.task == "lm":
            preds += greedy_decode(vlm, items, max_new_tokens)
            targets += [r["answer"] for r in chunk]
            continue
        hidden, mask = hidden_states(vlm, items)
        for r, result in zip(chunk, head.predict(hidden, mask, batch_token_xy(items))):
            preds.append({"classify": result.label, "count": result.count, "binary": result.answer,
                          "detect": result.boxes}[info.task])
            targets.append(head_target(info, r))
    if info.task == "lm":
        score = exact_match(preds, targets)
    elif info.task == "detect":
        score = f1_at_iou(preds, targets, 0.5)
    else:
        score = accuracy(preds, targets)
    return {"accuracy": float(score), "metric": METRICS[info.task], "n": n, "task": info.task}
