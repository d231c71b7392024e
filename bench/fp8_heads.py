"""FP8 against bf16 on trained adapters' task-head answers (`bench.fp8.heads=true`, section "heads").

The rest of the fp8 suite measures logits at the 7B shape with random weights, where bf16 itself
agrees with fp32 on a quarter of the tokens: it says nothing about what a user is served. Here the
adapters are trained (bench/fp8_heads_data.py: `bench.fp8.adapters_dir`, e.g. the demo's fused
adapters, or small ones trained on the world in process), and the same held-out world items go to
a bf16 engine and to an FP8 engine (quantization=fp8), output_mode="head", unmerged (every adapter
in one mixed batch) and merged (each adapter merged in turn). Rows, one per domain, mode and pair:

    kind=head     agreement      share of items whose answers are equal (class / yes-no / count), or
                                 whose boxes pair up one to one at IoU >= 0.5 (detect)
                  count_mad      count: mean |fp8 count - bf16 count|;  box_f1: detect, fp8 against bf16
                  conf_mad       mean |fp8 confidence - bf16 confidence|
                  bf16_truth, fp8_truth   each precision's score against the items' truth (top-1, or
                                 F1 at IoU 0.5 for detect; `truth_from` says whose answers those are)
                  majority_truth the top-1 of always giving the items' commonest true answer, beside them
                                 (none for detect): an adapter at or under it has learned nothing
    kind=caption  greedy text tokens of the first adapter on a few caption prompts: token_agreement,
                  first_divergence_min / _median, and bf16's top-1 minus top-2 logit at each first
                  divergence (top2_margin_*): how near bf16 itself was to another token there

A `bf16 rerun` row per domain (the bf16 engine answering again) must agree at 1.0: the comparison's
own sanity check. On the CPU the FP8 engine runs only under serve.models.fp8.ALLOW_CPU (tests).
"""

from __future__ import annotations

import gc
import statistics
from collections import Counter
import sys
from pathlib import Path

import torch

from heads.metrics import detection_counts
from serve.engine import Engine, EngineConfig, Request, SamplingParams
from serve.models import fp8 as fp8_models
from serve.orchestrator import Mode

from .fp8_accuracy import compare_outputs
from .fp8_heads_data import (HeadAdapter, adapters_from_dir, check_heads_options, eval_items, trained_adapters,
                             truth_from)

CAPTION = "Describe the picture."
IOU = 0.5
AGREEMENT_TARGET = 0.99  # the FP8 issue's: head answers equal to bf16's on at least 99% of items, per task


def check_heads_job(job) -> None:
    """Every heads option, and FP8 on this device, checked before anything is built."""
    device = torch.device(job.device)
    if device.type == "cpu" and not fp8_models.ALLOW_CPU:
        raise ValueError("bench.fp8.heads=true measures FP8 head answers on a GPU (compute capability >= 8.9); "
                         "on the CPU it runs only under serve.models.fp8.ALLOW_CPU (tests)")
    if device.type == "cuda":
        fp8_models.check_quantization("fp8", device)
    check_heads_options(job)


def _engine(job, adapters: list[HeadAdapter], quantization: str) -> Engine:
    cuda = job.device.startswith("cuda")
    config = EngineConfig(device=job.device, dtype="bfloat16", quantization=quantization, max_batch_size=32,
                          max_tokens_per_step=8192, num_kv_blocks=32 * 64 + 64, cuda_graphs=cuda,
                          graph_batch_sizes=(1, 2, 4, 8, 16, 32),  # no bucket above max_batch_size
                          lora_graph_segments=(), lora_graph_seg_lens=(), encoder_cache_items=0,
                          enable_prefix_cache=False, seed=job.seed, warm_up="off", encode_ahead="off",
                          vision_compile=False, adapter_slots=len(adapters), host_adapter_cache=len(adapters),
                          max_lora_rank=max(a.rank for a in adapters),
                          lora_targets=tuple(sorted({t for a in adapters for t in a.targets})) or
                          EngineConfig.lora_targets)
    engine = Engine(adapters[0].base, config)
    for a in adapters:
        engine.load_adapter(a.name, a.path)
    return engine


def _head_requests(adapter: HeadAdapter, items: dict) -> list[Request]:
    return [Request(prompt=it.prompt, raw_prompt=True, images=[it.image] if it.image is not None else [],
                    video=it.video, adapter=adapter.name, output_mode="head", task=domain)
            for domain in adapter.domains for it in items[adapter.name, domain]]


def _split(adapter: HeadAdapter, items: dict, outs: list) -> dict:
    got, i = {}, 0
    for domain in adapter.domains:
        n = len(items[adapter.name, domain])
        got[adapter.name, domain] = [o.head for o in outs[i:i + n]]
        i += n
    return got


def _unmerged(engine: Engine, adapters: list[HeadAdapter], items: dict) -> dict:
    """Every adapter's items in one mixed batch: ("unmerged", adapter, domain) -> head results."""
    outs, out, i = engine.generate([r for a in adapters for r in _head_requests(a, items)]), {}, 0
    for a in adapters:
        n = sum(len(items[a.name, d]) for d in a.domains)
        out.update({("unmerged", *k): v for k, v in _split(a, items, outs[i:i + n]).items()})
        i += n
    return out


def _caption_requests(adapter: HeadAdapter, items: list, job) -> list[Request]:
    params = SamplingParams(max_tokens=job.heads_caption_tokens, ignore_eos=True, keep_logits=True, detokenize=False)
    pictures = [it for it in items if it.image is not None][:job.heads_captions]
    return [Request(prompt=CAPTION, images=[it.image], adapter=adapter.name, sampling=params) for it in pictures]


def _answers(engine: Engine, adapters: list[HeadAdapter], items: dict, job, rerun: bool = False) -> dict:
    """(mode, adapter, domain) -> head results, and (mode, "caption") -> the caption outputs; with `rerun`,
    ("rerun", adapter, domain): the unmerged batch again, before any merge (a bf16 merge and unmerge
    round the weights, so a rerun after one would not be the same weights)."""
    out = _unmerged(engine, adapters, items)
    if rerun:
        out.update({("rerun", *k[1:]): v for k, v in _unmerged(engine, adapters, items).items()})
    first, pictures = _caption_source(adapters, items)
    captions = _caption_requests(first, pictures, job) if first else []
    if captions:
        out["unmerged", "caption"] = _keep(engine.generate(captions))
    for a in adapters:
        engine.set_mode(Mode.merge(a.name))
        out.update({("merged", *k): v for k, v in _split(a, items, engine.generate(_head_requests(a, items))).items()})
        if a is first and captions:
            out["merged", "caption"] = _keep(engine.generate(_caption_requests(first, pictures, job)))
        engine.set_mode(Mode.unmerge())
    return out


def _caption_source(adapters: list[HeadAdapter], items: dict) -> tuple[HeadAdapter | None, list]:
    """The first adapter with a picture domain, and that domain's items (captions ask about a picture)."""
    for a in adapters:
        for d in a.domains:
            if any(it.image is not None for it in items[a.name, d]):
                return a, items[a.name, d]
    return None, []


def _keep(outs: list) -> list:
    for o in outs:  # on the host: two engines' worth of vocabulary-wide logits
        o.logits = [x.float().cpu() for x in o.logits]
    return outs


def _answer_of(task: str, r):
    return r.count if task == "count" else (r.answer or r.label) if task == "binary" else r.label


def _truth_of(task: str, truth: dict):
    return truth["count"] if task == "count" else truth["label"]


def head_agreement(task: str, ref: list, got: list) -> dict:
    """Agreement of two precisions' head results on the same items (see the module doc)."""
    row = dict(items=len(ref), conf_mad=statistics.mean(abs(a.confidence - b.confidence) for a, b in zip(ref, got)))
    if task == "detect":
        agree = [(c := detection_counts([b.boxes or []], [a.boxes or []], IOU))["fp"] == 0 and c["fn"] == 0
                 for a, b in zip(ref, got)]
        row["box_f1"] = detection_counts([b.boxes or [] for b in got], [a.boxes or [] for a in ref], IOU)["f1"]
    else:
        agree = [_answer_of(task, a) == _answer_of(task, b) for a, b in zip(ref, got)]
    if task == "count":
        row["count_mad"] = statistics.mean(abs(a.count - b.count) for a, b in zip(ref, got))
    row["agreement"] = sum(agree) / len(agree)
    row["differ"] = len(agree) - sum(agree)  # items answered differently: what the target allows is a count too
    row["target_met"] = row["agreement"] >= AGREEMENT_TARGET
    return row


def truth_score(task: str, results: list, items: list) -> float:
    """Top-1 against the items' answers, or F1 at IoU 0.5 for detect."""
    if task == "detect":
        return detection_counts([r.boxes or [] for r in results], [it.truth["boxes"] for it in items], IOU)["f1"]
    return sum(_answer_of(task, r) == _truth_of(task, it.truth) for r, it in zip(results, items)) / len(items)


def majority_score(task: str, items: list) -> float | None:
    """Top-1 of always giving the items' commonest true answer: the score a head must beat to have learned
    anything. None for detect, where no single answer is shared (no boxes at all scores F1 0)."""
    if task == "detect":
        return None
    answers = Counter(_truth_of(task, it.truth) for it in items)
    return answers.most_common(1)[0][1] / len(items)


def caption_row(ref: list, got: list) -> dict:
    """Greedy tokens of fp8 against bf16 (bench/fp8_accuracy.py) and bf16's top-2 gap at each first divergence."""
    acc = compare_outputs(ref, got)
    margins = []
    for r, g in zip(ref, got):
        first = next((i for i, (x, y) in enumerate(zip(r.token_ids, g.token_ids)) if x != y), None)
        if first is not None:
            top = r.logits[first].float().topk(2).values
            margins.append((top[0] - top[1]).item())
    return dict(prompts=acc["prompts"], token_agreement=acc["token_agreement"], diverged=acc["diverged"],
                first_divergence_min=acc["first_divergence_min"], first_divergence_median=acc["first_divergence_median"],
                top2_margin_min=min(margins) if margins else None,
                top2_margin_median=statistics.median(margins) if margins else None)


def heads_rows(job, workdir: Path) -> list[dict]:
    """The heads section's rows (check_heads_job has passed)."""
    log = sys.stderr
    adapters = adapters_from_dir(job.adapters_dir) if job.adapters_dir else trained_adapters(job, workdir, log)
    items = {(a.name, d): eval_items(rec, job.heads_items) for a in adapters for d, rec in a.domains.items()}
    answers = {}
    for name, quantization in (("bf16", "none"), ("fp8", "fp8")):
        engine = _engine(job, adapters, quantization)
        answers[name] = _answers(engine, adapters, items, job, rerun=name == "bf16")
        if name == "bf16":  # the comparison's sanity check: the bf16 engine again on the same batch
            answers["bf16 rerun"] = {("unmerged", *k[1:]): v for k, v in answers["bf16"].items() if k[0] == "rerun"}
        print(f"fp8 heads: {name} answered", file=log, flush=True)
        del engine
        gc.collect()
        if job.device.startswith("cuda"):
            torch.cuda.empty_cache()
    rows = []
    for a in adapters:
        for domain, rec in a.domains.items():
            task, its = rec["task"], items[a.name, domain]
            for mode in ("unmerged", "merged"):
                key = (mode, a.name, domain)
                ref = answers["bf16"][key]
                for precision in ("fp8", "bf16 rerun") if mode == "unmerged" else ("fp8",):
                    got = answers[precision][key]
                    rows.append(dict(section="heads", kind="head", adapter=a.name, domain=domain, task=task,
                                     mode=mode, precision=precision, against="bf16", **head_agreement(task, ref, got),
                                     bf16_truth=truth_score(task, ref, its), fp8_truth=truth_score(task, got, its)
                                     if precision == "fp8" else None, majority_truth=majority_score(task, its),
                                     truth_metric="f1@0.5" if task == "detect" else "top1", truth_from=truth_from(rec)))
    for mode in ("unmerged", "merged"):
        if (mode, "caption") in answers["bf16"]:
            rows.append(dict(section="heads", kind="caption", adapter=_caption_source(adapters, items)[0].name,
                             mode=mode, precision="fp8",
                             against="bf16", **caption_row(answers["bf16"][mode, "caption"],
                                                           answers["fp8"][mode, "caption"])))
    return rows


def heads_lines(rows: list[dict]) -> list[str]:
    """fp8.md's heads tables (none when the section did not run)."""
    from .fp8_report import _table

    heads = [r for r in rows if r.get("section") == "heads" and r["kind"] == "head"]
    captions = [r for r in rows if r.get("section") == "heads" and r["kind"] == "caption"]
    if not heads:
        return []
    lines = ["", "## Trained adapters' head answers, FP8 against bf16 (same items)", ""]
    lines += [f"`target_met`: agreement >= {AGREEMENT_TARGET:g}; `majority_truth`: the score of always giving the "
              "commonest true answer (a head at or under it has learned nothing).", ""]
    lines += _table(heads, ("adapter", "domain", "task", "mode", "precision", "items", "agreement", "differ",
                            "target_met", "count_mad",
                            "box_f1", "conf_mad", "bf16_truth", "fp8_truth", "majority_truth", "truth_metric",
                            "truth_from"))
    if captions:
        lines += ["", "Greedy caption tokens, FP8 against bf16 (top-2 margin: bf16's top-1 minus top-2 logit at "
                      "the first divergence)", ""]
        lines += _table(captions, ("adapter", "mode", "prompts", "token_agreement", "diverged", "first_divergence_min",
                                   "first_divergence_median", "top2_margin_min", "top2_margin_median"))
    return lines
