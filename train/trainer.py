"""`train_adapter`: LoRA + task head on one domain dataset, with checkpoints, resume and evaluation.

AdamW over two parameter groups (LoRA at `lr`, the head at `head_lr`), linear warm-up then
cosine decay, gradient accumulation, `accelerate` for device placement and mixed precision
(fp32 on CPU). Heads define their own losses; `lm` domains train the LM head on the answer
tokens with the prompt masked out. A checkpoint (LoRA, head, optimiser, scheduler, RNG, step)
is written every `save_every` steps, and a run resumes from it exactly: the data order of an
epoch is a function of (seed, epoch), so a resumed run sees the batches the first one would have.
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from heads import HeadConfig, TaskHead, build_head
from world.progress import ProgressLine

from .baselines import baseline_note
from .calibrate import calibrate_threshold, describe
from .checkpoint import load_checkpoint, save_checkpoint
from .data import DomainData, DomainInfo, collate, head_target
from .evaluate import at_default_note, evaluate
from .model import AdapterModule, maybe_compile
from .vlm import VisionLM


@dataclass
class TrainConfig:
    """One training run (conf/train.yaml `train:`)."""

    epochs: int = 2
    max_steps: int | None = None  # stop after this many optimiser steps when set
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 2e-4
    head_lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    max_grad_norm: float = 1.0
    eval_every: int = 0  # steps between evaluations on the eval split; 0 = only at the end
    save_every: int = 0  # steps between resumable checkpoints; 0 = none
    seed: int = 0
    max_new_tokens: int = 8  # lm domains: greedy decoding length at evaluation
    eval_batch_size: int = 32
    compile: bool = False  # torch.compile the training forward (GPU: eager steps are bound by kernel launches)
    # detect heads: after training, set the score threshold to the one with the best F1 on the train
    # split (train/calibrate.py); a fixed 0.5 can cost several points of F1
    calibrate_threshold: bool = True

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "grad_accum"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TrainConfig.{name}={v!r}: must be an int >= 1")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"TrainConfig.max_steps={self.max_steps!r}: must be >= 0 or None")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"TrainConfig.warmup_ratio={self.warmup_ratio!r}: must be in [0, 1)")


@dataclass
class TrainResult:
    lora: dict[str, Tensor]  # CPU copies of the trained LoRA weights (PEFT keys)
    head: TaskHead | None  # None for lm domains
    metrics: dict  # final evaluation on the eval split
    steps: int
    seconds: float
    history: list[dict] = field(default_factory=list)  # {"step", "loss"} per step; {"step", "eval"} periodic


def head_config_for(info: DomainInfo, hidden_size: int, overrides: dict | None = None) -> HeadConfig | None:
    """The head a domain needs (None for lm), sized from domain.json; `overrides` from conf/head."""
    if info.task == "lm":
        return None
    extra = {k: v for k, v in (overrides or {}).items() if v is not None and k != "type"}
    kw: dict = {"type": info.task, "hidden_size": hidden_size}
    if info.task == "classify":
        kw["labels"] = list(info.labels)
    if info.task == "count" and info.max_count:
        kw["max_count"] = int(info.max_count)
    if info.task == "detect" and info.max_boxes:
        kw["max_boxes"] = max(int(info.max_boxes), 1)
    kw.update(extra)
    return HeadConfig(**kw)


def _schedule(total: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


def _batch_loss(module: torch.nn.Module, head: TaskHead | None, batch: dict, targets: list) -> Tensor:
    out = module(batch, want_logits=head is None)
    if head is None:  # next-token cross-entropy on the answer tokens only
        logits, labels = out["logits"][:, :-1], batch["labels"][:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)
    return head.loss(head(out["hidden"], out["mask"], out["token_xy"]),
                     head.targets_from(targets, device=out["hidden"].device))


def train_adapter(vlm: VisionLM, domain: DomainData, cfg: TrainConfig, head: TaskHead | None = None,
                  checkpoint_dir: str | Path | None = None, resume: bool = True, log=None,
                  evaluate_at_end: bool = True, zero_shot=None) -> TrainResult:
    """Train the LoRA currently in `vlm` (continuing from its weights) and `head` on `domain`.

    head: the domain's head to train (a fresh one from domain.json when None; ignored for lm).
    checkpoint_dir: where resumable checkpoints go (every cfg.save_every steps); with `resume`,
    a checkpoint there is loaded first and training continues from its step.
    zero_shot: a `train.zero_shot.ZeroShot`; the final evaluation then puts the score beside the
    base model's own answers (None: "zero-shot: not measured").
    """
    log = log or sys.stderr
    info, start_time = domain.info, time.perf_counter()
    if info.task != "lm" and head is None:
        head = build_head(head_config_for(info, vlm.hidden_size))
    if info.task == "lm":
        head = None
    acc = vlm.accelerator
    n = domain.size("train")
    if n == 0:
        raise ValueError(f"domain {info.name!r}: the train split is empty")
    per_epoch = math.ceil(math.ceil(n / cfg.batch_size) / cfg.grad_accum)
    total = per_epoch * cfg.epochs if cfg.max_steps is None else min(cfg.max_steps, per_epoch * cfg.epochs)

    torch.manual_seed(cfg.seed)
    module = maybe_compile(AdapterModule(vlm.model, head), cfg.compile)
    groups = [{"params": vlm.lora_parameters(), "lr": cfg.lr}]
    if head is not None:
        head.to(vlm.device)
        groups.append({"params": list(head.parameters()), "lr": cfg.head_lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(total, int(cfg.warmup_ratio * total)))
    # The scheduler stays unprepared: accelerate would step it once per process, but every
    # process here takes its share of the same batch, so one step per optimiser step is right.
    module, optimizer = acc.prepare(module, optimizer)

    step, history = 0, []
    if checkpoint_dir is not None and resume:
        state = load_checkpoint(checkpoint_dir, vlm, head, optimizer, scheduler, info.name)
        if state is not None:
            step, history = state["step"], state["history"]
            print(f"[train {info.name}] resumed from step {step} ({checkpoint_dir})", file=log, flush=True)

    rank, world = acc.process_index, acc.num_processes
    module.train()
    last_print, t0, step0, bar = 0.0, time.perf_counter(), step, ProgressLine(log)
    while step < total:
        epoch, in_epoch = divmod(step, per_epoch)
        order = np.random.default_rng([cfg.seed, epoch]).permutation(n)
        batches = [order[i:i + cfg.batch_size] for i in range(0, n, cfg.batch_size)]
        batches = batches[in_epoch * cfg.grad_accum:]
        for k in range(0, len(batches), cfg.grad_accum):
            group = batches[k:k + cfg.grad_accum]
            loss_sum = 0.0
            for j, idx in enumerate(group):
                idx = idx[rank::world] if world > 1 else idx
                rows = domain.rows("train", idx, vlm.encoder)
                encoded = vlm.encoder.encode_many(rows, info)
                answers = [vlm.encoder.answer_ids(r["answer"]) for r in rows] if head is None else None
                batch = collate(encoded, vlm.encoder.pad_id, answers)
                sync = j == len(group) - 1
                with (nullcontext() if sync or world == 1 else acc.no_sync(module)):
                    loss = _batch_loss(module, head, batch, [head_target(info, r) for r in rows])
                    acc.backward(loss / len(group))
                loss_sum += loss.item() / len(group)
            if cfg.max_grad_norm:
                acc.clip_grad_norm_([p for g in groups for p in g["params"]], cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            history.append({"step": step, "loss": round(loss_sum, 5)})
            now = time.perf_counter()
            if now - last_print > 0.5 or step == total:
                last_print = now
                rate = (step - step0) / max(now - t0, 1e-9)
                bar.update(f"[train {info.name}] step {step}/{total} epoch {epoch + 1}/{cfg.epochs} "
                           f"loss {loss_sum:.4f} ({rate:.1f} steps/s)")
            if cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                metrics = evaluate(vlm, head, domain, "eval", cfg.eval_batch_size, cfg.max_new_tokens)
                history.append({"step": step, "eval": metrics})
                bar.end()  # the eval line below the progress it interrupts
                print(f"[train {info.name}] step {step}: eval {metrics['metric']} {metrics['accuracy']:.3f}",
                      file=log, flush=True)
                module.train()
            if checkpoint_dir is not None and cfg.save_every and (step % cfg.save_every == 0 or step == total):
                if acc.is_main_process:  # every process holds the same weights; one writes them
                    save_checkpoint(checkpoint_dir, vlm, head, optimizer, scheduler, step, history, info.name)
                acc.wait_for_everyone()
            if step >= total:
                break
    if total:
        bar.end()
    module.eval()
    if cfg.calibrate_threshold and info.task == "detect":
        print(describe(info.name, calibrate_threshold(vlm, head, domain, batch_size=cfg.eval_batch_size)),
              file=log, flush=True)
    metrics = evaluate(vlm, head, domain, "eval", cfg.eval_batch_size, cfg.max_new_tokens,
                       zero_shot=zero_shot) if evaluate_at_end else {}
    if metrics:
        print(f"[train {info.name}] {total} steps, eval {metrics['metric']} {metrics['accuracy']:.3f}"
              f"{at_default_note(metrics)}{baseline_note(metrics)} "
              f"on {metrics['n']} items ({time.perf_counter() - start_time:.1f} s)", file=log, flush=True)
    acc.free_memory()  # drop the accelerator's references to this run's module and optimiser
    return TrainResult(vlm.lora_state(), head, metrics, step, time.perf_counter() - start_time, history)
