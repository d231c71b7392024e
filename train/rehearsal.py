"""Training one adapter on several domains at once: rehearsal while fusing, and head re-fits.

When a domain joins an adapter that already holds others, training the shared LoRA on the new
domain alone moves the hidden states under the members' frozen heads, and they fall below their
requirements (the paper's Fig. 10 effect, made worse on small models). Two remedies, both here:

- `train_mixed`: one pass over the new domain's train split per epoch, interleaved with batches
  rehearsed from each member's train split (a share of the new domain's size, split evenly
  among the members), every batch through its own domain's head (lm members through the LM
  loss), all heads and the LoRA in one optimiser under one schedule. Batches are single-domain
  so each goes through one head; their order is shuffled so no domain comes last.
- `refit_heads`: with the LoRA frozen, each head is trained a few more epochs on its domain's
  hidden states, computed once (the language model runs forward only once per item), so every
  member's head fits the adapter it is evaluated with. Heads are small; this costs a forward
  pass over each member's train split.

Batch order is a function of (seed, epoch), as in `train_adapter`.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from heads import TaskHead
from world.progress import ProgressLine

from .data import DomainData, batch_token_xy, collate, head_target
from .evaluate import hidden_states
from .model import AdapterModule, maybe_compile
from .trainer import TrainConfig, _batch_loss, _schedule
from .vlm import VisionLM


@dataclass
class Part:
    """One domain in a mixed run: its data, its head (None for lm) and the rows it gives per epoch
    (None: its whole train split, once)."""

    data: DomainData
    head: TaskHead | None
    rows_per_epoch: int | None = None


def rehearsal_parts(new: Part, members: list[Part], share: float) -> list[Part]:
    """`new` plus each member rehearsing `share` x new's train size / len(members) rows per epoch
    (at least one batch's worth is not forced: a tiny share gives a tiny rehearsal)."""
    if share < 0:
        raise ValueError(f"rehearsal share must be >= 0, got {share!r}")
    n_new = new.data.size("train")
    each = math.ceil(share * n_new / len(members)) if members else 0
    return [new] + [Part(m.data, m.head, min(each, m.data.size("train"))) for m in members if each > 0]


def _epoch_batches(parts: list[Part], batch_size: int, seed: int, epoch: int) -> list[tuple[int, list[int]]]:
    """(part index, row indices) of every batch of one epoch, in a shuffled order."""
    rng = np.random.default_rng([seed, epoch, 7])
    batches = []
    for p, part in enumerate(parts):
        n = part.data.size("train")
        take = n if part.rows_per_epoch is None else part.rows_per_epoch
        order = rng.permutation(n)[:take]
        batches += [(p, order[i:i + batch_size].tolist()) for i in range(0, take, batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def train_mixed(vlm: VisionLM, parts: list[Part], cfg: TrainConfig, log=None) -> tuple[dict[str, Tensor], int]:
    """Train the LoRA in `vlm` and every part's head on the mixed batch stream; returns the LoRA
    (CPU copies) and the number of optimiser steps. Heads are trained in place."""
    log = log or sys.stderr
    if not parts:
        raise ValueError("train_mixed: no domains given")
    for part in parts:
        if part.data.size("train") == 0:
            raise ValueError(f"domain {part.data.name!r}: the train split is empty")
        if (part.head is None) != (part.data.info.task == "lm"):
            raise ValueError(f"domain {part.data.name!r} (task {part.data.info.task!r}): a head is needed "
                             "for every task but lm, and lm takes none")
    per_epoch = math.ceil(len(_epoch_batches(parts, cfg.batch_size, cfg.seed, 0)) / cfg.grad_accum)
    total = per_epoch * cfg.epochs if cfg.max_steps is None else min(cfg.max_steps, per_epoch * cfg.epochs)
    torch.manual_seed(cfg.seed)
    heads = [p.head for p in parts if p.head is not None]
    for h in heads:
        h.to(vlm.device).train()
    groups = [{"params": vlm.lora_parameters(), "lr": cfg.lr}]
    groups += [{"params": list(h.parameters()), "lr": cfg.head_lr} for h in heads]
    optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(total, int(cfg.warmup_ratio * total)))
    module = maybe_compile(AdapterModule(vlm.model, None).to(vlm.device), cfg.compile)
    module.train()
    names = "+".join(p.data.name for p in parts)
    step, last_print, t0, bar = 0, 0.0, time.perf_counter(), ProgressLine(log)
    for epoch in range(cfg.epochs):
        batches = _epoch_batches(parts, cfg.batch_size, cfg.seed, epoch)
        for k in range(0, len(batches), cfg.grad_accum):
            if step >= total:
                break
            group, loss_sum = batches[k:k + cfg.grad_accum], 0.0
            for p, idx in group:
                part = parts[p]
                info, rows = part.data.info, part.data.rows("train", idx, vlm.encoder)
                encoded = vlm.encoder.encode_many(rows, info)
                answers = [vlm.encoder.answer_ids(r["answer"]) for r in rows] if part.head is None else None
                with vlm.accelerator.autocast():
                    loss = _batch_loss(module, part.head, collate(encoded, vlm.encoder.pad_id, answers),
                                       [head_target(info, r) for r in rows])
                (loss / len(group)).backward()
                loss_sum += loss.item() / len(group)
            if cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_([q for g in groups for q in g["params"]], cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            now = time.perf_counter()
            if now - last_print > 0.5 or step == total:
                last_print = now
                bar.update(f"[train {names}] step {step}/{total} epoch {epoch + 1}/{cfg.epochs} loss {loss_sum:.4f} "
                           f"({step / max(now - t0, 1e-9):.1f} steps/s)")
    if total:
        bar.end()
    module.eval()
    for h in heads:
        h.eval()
    return vlm.lora_state(), step


def refit_heads(vlm: VisionLM, parts: list[Part], cfg: TrainConfig, epochs: int, log=None) -> None:
    """Train each part's head (in place) for `epochs` epochs on its domain's hidden states under
    the LoRA now in `vlm`, which stays frozen; lm parts have no head and are skipped."""
    log = log or sys.stderr
    if epochs <= 0:
        return
    for part in parts:
        head, info = part.head, part.data.info
        if head is None:
            continue
        n = part.data.size("train")
        cached: list[tuple[Tensor, Tensor, Tensor | None, list]] = []
        for start in range(0, n, cfg.eval_batch_size):  # the LM runs forward once per item
            chunk = part.data.rows("train", range(start, min(n, start + cfg.eval_batch_size)), vlm.encoder)
            items = vlm.encoder.encode_many(chunk, info)
            hidden, mask = hidden_states(vlm, items)
            cached.append((hidden.float(), mask, batch_token_xy(items), [head_target(info, r) for r in chunk]))
        head.to(vlm.device).train()
        optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.head_lr, weight_decay=cfg.weight_decay)
        rng = np.random.default_rng([cfg.seed, 11])
        for _ in range(epochs):
            for b in rng.permutation(len(cached)):  # minibatches of the training batch size
                hidden, mask, xy, targets = cached[b]
                for i in range(0, len(targets), cfg.batch_size):
                    sl = slice(i, i + cfg.batch_size)
                    outputs = head(hidden[sl], mask[sl], None if xy is None else xy[sl])
                    loss = head.loss(outputs, head.targets_from(targets[sl], device=hidden.device))
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        head.eval()
        print(f"[refit {info.name}] head re-fit {epochs} epochs on {n} items (last loss {loss.item():.4f})",
              file=log, flush=True)
