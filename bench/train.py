"""`vlora bench bench.suite=train`: our trainer against plain transformers + PEFT, same batches.

Ours is the project's training path: `VisionLM` (PEFT LoRA on the language model, accelerate,
bf16 autocast on a GPU), the `Encoder`'s per-item cache of the frozen vision tower's features,
`AdapterModule` (the language model only, each step) and a count head (`loss: head`) or the LM
loss (`loss: lm`), with gradient checkpointing and `torch.compile` of the training forward as options. Plain is bench/train_plain.py. Both
load the same zoo checkpoint (published shape, random weights), start from the same LoRA and train
on the same rows in the same order, one after the other in this process. Per (model, method,
seed): samples/s, tokens/s, peak memory, step time and the share of the measured matmul peak.
The timed run is `epochs` whole epochs over `dataset_size` rows, as a real training run goes; the
warm-up steps train on rows of their own, so every timed first-epoch step of ours pays its
encoding (processor and one batched tower call, then cached). Plain's processor work runs
untimed, as a prefetching loader hides it; its tower runs inside every step.
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .results import device_label, results_dir, write_csv, write_json
from .train_plain import (batch_order, make_rows, matmul_peak_tflops, print_table, run_plain, run_steps, step_flops,
                          summarize, sync)

METHODS = ("ours", "plain")
LOSSES = ("head", "lm")
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEY = ("model", "method", "seed", "loss", "gradient_checkpointing", "compile", "rank", "targets", "batch_size",
       "epochs", "image_size", "dtype")  # a rerun skips the rows of train.csv with these values
COLUMNS = ("gpu", *KEY, "status", "warmup", "samples_per_s", "tokens_per_s", "tokens_per_sample",
           "visual_tokens_per_sample", "peak_mem_gib", "step_ms_median", "step_ms_mean", "model_tflop_per_step",
           "achieved_tflops", "matmul_peak_tflops", "mfu", "vision_items_per_step", "first_loss", "last_loss",
           "batches_sha", "wall_s")


@dataclass
class TrainBenchJob:
    models: tuple[str, ...] = ("qwen2_vl_2b", "qwen2_vl_7b")
    methods: tuple[str, ...] = METHODS
    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0  # no dropout: the two methods' first steps must compute the same thing
    targets: tuple[str, ...] | str = ("q_proj", "k_proj", "v_proj", "o_proj")  # or "all": the seven
    loss: str = "head"  # ours: a count head, or lm (plain always trains the LM loss)
    batch_size: int = 8
    epochs: int = 4  # timed: whole epochs over dataset_size rows (conf/train.yaml trains 4)
    warmup: int = 3  # untimed steps first, on rows the timed epochs do not use
    image_size: int = 448
    dataset_size: int = 64  # distinct rows; steps past one epoch reuse them (ours then hits its cache)
    max_count: int = 9
    seeds: tuple[int, ...] = (0,)
    gradient_checkpointing: bool = False  # ours only
    compile: bool = False  # ours only: torch.compile of the training forward (compiled in the warm-up)
    lr: float = 2e-4
    head_lr: float = 1e-3
    max_grad_norm: float = 1.0
    device: str | None = None  # None: cuda
    dtype: str = "bfloat16"  # base weights of both methods; bf16 autocast for ours on a GPU
    matmul_n: int = 8192
    zoo_dir: str = ".vlora/zoo"
    zoo_seed: int = 0
    out_dir: str = "results/train"
    command: str | None = None

    def __post_init__(self) -> None:
        from zoo import SPECS

        def bad(key, why):
            raise ValueError(f"bench.train.{key}={getattr(self, key)!r}: {why}")
        for key in ("rank", "alpha", "batch_size", "epochs", "image_size", "dataset_size", "max_count", "matmul_n"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(key, "must be an int >= 1")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            bad("warmup", "must be an int >= 0")
        qwen = [n for n, s in SPECS.items() if s.arch in ("qwen2_vl", "qwen2_5_vl")]
        if isinstance(self.models, str) or not self.models or any(m not in qwen for m in self.models):
            bad("models", f"a non-empty list of Qwen zoo models: {qwen}")
        if isinstance(self.methods, str) or not self.methods or len(set(self.methods)) < len(self.methods) \
                or any(m not in METHODS for m in self.methods):
            bad("methods", f"a non-empty list of distinct methods from {list(METHODS)}")
        self.targets = ALL_TARGETS if self.targets == "all" else self.targets
        if isinstance(self.targets, str) or not self.targets or any(t not in ALL_TARGETS for t in self.targets):
            bad("targets", f"'all' or a list of projections from {list(ALL_TARGETS)}")
        if self.loss not in LOSSES:
            bad("loss", f"must be one of {list(LOSSES)}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            bad("dtype", "must be bfloat16, float16 or float32")
        if self.image_size < 56:
            bad("image_size", "must be >= 56 (two merged 28-pixel patches)")
        if self.dataset_size < self.batch_size:
            bad("dataset_size", f"must hold at least one batch (batch_size={self.batch_size})")
        if isinstance(self.seeds, (str, int)) or not self.seeds:
            bad("seeds", "a non-empty list of ints")
        if any(not isinstance(s, int) or isinstance(s, bool) for s in self.seeds):
            bad("seeds", "a non-empty list of ints")
        if self.device not in (None, "cuda", "cpu"):  # accelerate places ours on the process's GPU
            bad("device", "null (cuda), cuda or cpu")
        if self.device != "cpu" and not torch.cuda.is_available():
            bad("device", "asks for CUDA but none is available; device=cpu runs with a tiny zoo model "
                          "(models=[qwen2_vl_tiny] image_size=112 dtype=float32)")

    def lora_spec(self):
        from train.model import LoraSpec

        return LoraSpec(rank=self.rank, alpha=self.alpha, dropout=self.dropout, target_modules=list(self.targets))


def run_ours(job: TrainBenchJob, name: str, path: str, rows, order, seed: int, device: torch.device) -> dict:
    from heads import build_head
    from train import AdapterModule, DomainInfo, ModelRef, VisionLM, collate
    from train.data import head_target
    from train.model import maybe_compile
    from train.trainer import _batch_loss, head_config_for

    cuda = device.type == "cuda"
    mixed = {"bfloat16": "bf16", "float16": "fp16"}.get(job.dtype, "no") if cuda else "no"
    vlm = VisionLM(ModelRef(name, path, dtype=job.dtype), job.lora_spec(), mixed_precision=mixed,
                   device=str(device), seed=seed, gradient_checkpointing=job.gradient_checkpointing)
    acc = vlm.accelerator
    try:
        info = DomainInfo("bench_count", "count" if job.loss == "head" else "lm", max_count=job.max_count)
        head = build_head(head_config_for(info, vlm.hidden_size)) if job.loss == "head" else None
        groups = [{"params": vlm.lora_parameters(), "lr": job.lr}]
        if head is not None:
            groups.append({"params": list(head.to(vlm.device).parameters()), "lr": job.head_lr})
        params = [p for g in groups for p in g["params"]]
        module = maybe_compile(AdapterModule(vlm.model, head), job.compile)
        module, optimizer = acc.prepare(module, torch.optim.AdamW(groups))
        module.train()
        enc = vlm.encoder

        def step(batch_rows):  # train_adapter's inner step; encoding (a cache hit after epoch 1) is timed
            misses = sum(not enc.has(r, info) for r in batch_rows)
            encoded = enc.encode_many(batch_rows, info)
            answers = [enc.answer_ids(r["answer"]) for r in batch_rows] if head is None else None
            batch = collate(encoded, enc.pad_id, answers)
            loss = _batch_loss(module, head, batch, [head_target(info, r) for r in batch_rows])
            acc.backward(loss)
            acc.clip_grad_norm_(params, job.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach(), batch["attention_mask"].sum(dim=1).tolist(), misses

        out = run_steps(rows, order, job.warmup, device, lambda r: r, step)
    finally:
        acc.free_memory()  # drop accelerate's references to the module and optimiser
    out["loss"] = job.loss
    return out


def _measure(job, name, path, method, rows, seed, device, config, item_flops, peak) -> dict:
    """One method's run: the measured columns of its row (status oom when it ran out of memory)."""
    row = {}
    n = job.dataset_size  # rows[n:] are the warm-up's own
    warm = [list(range(n + i * job.batch_size, n + (i + 1) * job.batch_size)) for i in range(job.warmup)]
    order = warm + batch_order(n, job.batch_size, job.epochs * (n // job.batch_size), seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    try:
        out = (run_ours if method == "ours" else run_plain)(job, name, path, rows, order, seed, device)
        row["status"] = "ok"
    except torch.cuda.OutOfMemoryError:
        out, row["status"] = None, "oom"
    sync(device)
    row["wall_s"] = time.perf_counter() - t0
    row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    if out is not None:
        total, steps = sum(out["times"]), len(out["times"])
        flops = sum(step_flops(config, job, lens, out["loss"], v, item_flops)
                    for lens, v in zip(out["lens"], out["vision_items"]))
        row.update(samples_per_s=steps * job.batch_size / total, tokens_per_s=sum(map(sum, out["lens"])) / total,
                   tokens_per_sample=sum(map(sum, out["lens"])) / (steps * job.batch_size),
                   step_ms_median=out["step_ms_median"], step_ms_mean=out["step_ms_mean"],
                   model_tflop_per_step=flops / steps / 1e12, achieved_tflops=flops / total / 1e12,
                   vision_items_per_step=sum(out["vision_items"]) / steps, first_loss=out["losses"][0],
                   last_loss=out["losses"][-1], batches_sha=out["batches_sha"])
        row["mfu"] = row["achieved_tflops"] / peak
    return row


def _key_fields(job: TrainBenchJob, name: str, method: str, seed: int) -> dict:
    return {"model": name, "method": method, "seed": seed, "loss": job.loss if method == "ours" else "lm",
            "gradient_checkpointing": job.gradient_checkpointing and method == "ours",
            "compile": job.compile and method == "ours", "rank": job.rank,
            "targets": "+".join(job.targets), "batch_size": job.batch_size, "epochs": job.epochs,
            "image_size": job.image_size, "dtype": job.dtype}


def _key(row: dict) -> tuple:
    return tuple(str(row.get(k, False)) for k in KEY)  # rows read back hold strings; a later column: False


def run_train_bench(job: TrainBenchJob) -> tuple[list[dict], dict]:
    import csv

    from transformers import AutoConfig, AutoProcessor

    from zoo import build_checkpoint

    from .vision import _tower_flops

    device = torch.device(job.device or "cuda")
    gpu = device_label(device)
    out = results_dir(job.out_dir, gpu)
    rows = list(csv.DictReader(open(out / "train.csv", newline=""))) if (out / "train.csv").is_file() else []
    done = {_key(r) for r in rows}
    todo = [(n, s, m) for n in job.models for s in job.seeds for m in job.methods
            if _key(_key_fields(job, n, m, s)) not in done]
    skipped = len(job.models) * len(job.seeds) * len(job.methods) - len(todo)
    print(f"[train] {len(todo)} runs to do, {skipped} already in {out / 'train.csv'}", file=sys.stderr, flush=True)
    peak = matmul_peak_tflops(device, job.matmul_n)
    for name in dict.fromkeys(n for n, _, _ in todo):
        path = str(build_checkpoint(name, Path(job.zoo_dir) / name, seed=job.zoo_seed, dtype=job.dtype,
                                    device=str(device)))
        _free(device)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        for seed in dict.fromkeys(s for n, s, _ in todo if n == name):
            data = make_rows(job.dataset_size + job.warmup * job.batch_size, job.image_size, job.max_count, seed)
            grid = processor.image_processor(images=[data[0]["image"]], return_tensors="pt")["image_grid_thw"][0]
            item_flops = _tower_flops(config.vision_config, config.model_type, [grid.tolist()])
            visual = int(grid.prod()) // config.vision_config.spatial_merge_size ** 2
            for method in [m for n, s, m in todo if (n, s) == (name, seed)]:
                print(f"[train] {name} seed {seed}: {method}", file=sys.stderr, flush=True)
                row = {"gpu": gpu, **_key_fields(job, name, method, seed), "warmup": job.warmup,
                       "matmul_peak_tflops": peak, "visual_tokens_per_sample": visual}
                row.update(_measure(job, name, path, method, data, seed, device, config, item_flops, peak))
                rows.append(row)
                _free(device)
                write_csv(out / "train.csv", rows, COLUMNS, drop_extra=True)  # after each: a crash loses one run
    index = {_key(r): r for r in rows}  # each model's rows of this job's settings, per method, seed by seed
    pairs = {n: {m: [index.get(_key(_key_fields(job, n, m, s))) for s in job.seeds] for m in METHODS}
             for n in job.models}
    summary = summarize(rows, pairs, job, gpu, peak, len(todo), skipped)
    write_json(out / "summary.json", summary)
    print_table([r for r in rows if r["model"] in job.models])
    return rows, summary


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
