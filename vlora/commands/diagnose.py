"""`vlora diagnose`: where a trained adapter loses its score on a domain, item by item.

For each domain asked (default: every one the fusion manifest serves) it loads the adapter that
serves it on its base model, answers the domain's eval split as training's evaluation does (greedy
decoding for free-form `lm` domains, the task head for classify, count and binary ones) and groups
the items: by kind of question (its first two words: "how many", "is there", ...) for lm domains,
by the true answer for head domains. Per group: items, score, the points of the domain's total it
costs and its commonest misses (truth -> answer); where truth and answer are numbers, the mean
signed and absolute error, which tells an off-by-one habit from noise. It answers whether a domain
below its requirement misses everywhere or on one kind of item.

    vlora diagnose                                             # every domain of the fusion manifest
    vlora diagnose 'diagnose.domains=[qa]' diagnose.out=qa.jsonl  # one domain, every item written out
    vlora diagnose diagnose.adapter=$VLORA_HOME/adapters/count  # a `vlora train` adapter directory

Detect domains are not tallied (an item's boxes have no single right answer; their F1 is in the
fusion report).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from ..config import to_dataclass
from .table import format_table

TALLIED = ("lm", "classify", "count", "binary")


@dataclass
class DiagnoseJob:
    manifest: str
    datasets: str  # where a domain's dataset is looked for when its adapter does not record one
    adapter: str | None = None
    domains: list[str] = field(default_factory=list)
    split: str = "eval"
    limit: int | None = None
    model: str | None = None
    base: bool = False
    device: str = "cpu"
    max_new_tokens: int = 8
    batch_size: int = 32
    out: str | None = None


def adapter_on_base(adapter: str | Path, model: str | None = None, lora: bool = True, device: str = "cpu"):
    """(vlm with the adapter's LoRA loaded, in eval mode; the adapter's state). The base is `model`,
    else the checkpoint the adapter's meta.json records. lora=False leaves the LoRA at zero: the
    base's own answers, through the same code."""
    from train import LoraSpec, VisionLM, load_adapter, read_meta
    from train.model import ModelRef

    state = load_adapter(adapter)
    meta = read_meta(adapter)
    spec = meta["lora"]
    vlm = VisionLM(ModelRef(name="base", path=model or meta["base_model"]["path"]),
                   LoraSpec(rank=spec["rank"], alpha=spec["alpha"], dropout=spec["dropout"],
                            target_modules=spec["target_modules"]), device=device)
    if lora:
        vlm.load_lora_state(state.lora)
    vlm.model.eval()  # as training's evaluation scores it: no LoRA dropout
    return vlm, state


def question_kind(question: str) -> str:
    """The question's first two words, lower case, punctuation dropped: its kind in any domain
    whose questions open the same way per kind (the world's qa does)."""
    words = "".join(c if c.isalnum() or c.isspace() else " " for c in question.lower()).split()
    return " ".join(words[:2]) or "(empty)"


def _number(value) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().rstrip(".")
    return int(text) if text.isdigit() else None


def by_group(rows: list[dict]) -> dict[str, dict]:
    """Per group (rows: group, target, pred, correct): items, score, the commonest wrong
    (target -> answer) pairs and, where every item's target and answer are numbers, the mean
    signed and absolute error."""
    out = {}
    for group in sorted({r["group"] for r in rows}):
        mine = [r for r in rows if r["group"] == group]
        wrong = [r for r in mine if not r["correct"]]
        nums = [(_number(r["pred"]), _number(r["target"])) for r in mine]
        out[group] = {"items": len(mine), "score": sum(r["correct"] for r in mine) / len(mine),
                      "wrong": Counter(f"{r['target']} -> {r['pred']}" for r in wrong).most_common(5)}
        if all(p is not None and t is not None for p, t in nums):  # a counting group: how far off, which way
            out[group]["mean_error"] = sum(p - t for p, t in nums) / len(nums)
            out[group]["mean_abs_error"] = sum(abs(p - t) for p, t in nums) / len(nums)
    return out


def item_rows(vlm, state, data, job: DiagnoseJob) -> list[dict]:
    """Every item of the split answered: id, question, group, target, pred, correct."""
    from heads.metrics import exact_match
    from train.evaluate import batches, greedy_decode, head_outputs, split_size

    info = data.info
    n = split_size(data, job.split, job.limit, "diagnose")
    rows = []
    if info.task == "lm":
        for chunk, items in batches(vlm, data, job.split, n, job.batch_size):
            for r, pred in zip(chunk, greedy_decode(vlm, items, job.max_new_tokens)):
                rows.append({"id": r["id"], "question": r["question"], "group": question_kind(r["question"]),
                             "target": r["answer"], "pred": pred, "correct": bool(exact_match(pred, r["answer"]))})
        return rows
    head = state.heads[info.name].build(vlm.device).eval()
    ids = data.splits[job.split]["id"][:n]
    for outputs, targets in head_outputs(vlm, head, data, job.split, n, job.batch_size):
        for result, target in zip(head.decode(outputs), targets):
            pred = {"classify": result.label, "count": result.count, "binary": result.answer}[info.task]
            rows.append({"id": ids[len(rows)], "question": info.question, "group": f"truth {target}",
                         "target": target, "pred": pred, "correct": pred == target})
    return rows


def _jobs(job: DiagnoseJob) -> list[tuple[str, str, float | None]]:
    """(domain, adapter directory, requirement or None) for each domain to diagnose."""
    if job.adapter:
        from train import read_meta

        served = {d: None for d in read_meta(job.adapter)["domains"]}
        where = f"adapter {job.adapter}"
    else:
        from adapters.manifest import ManifestError, read_manifest

        try:
            manifest = read_manifest(job.manifest)
        except ManifestError as e:
            raise SystemExit(f"diagnose.manifest: {e} (vlora fusion or vlora demo writes one; "
                             "or name one adapter directory: diagnose.adapter=PATH)") from None
        paths = {a["name"]: a["path"] for a in manifest["adapters"]}
        served = {d: (paths[t["adapter"]], t["requirement"]) for d, t in manifest["tasks"].items()}
        where = f"manifest {job.manifest}"
    unknown = [d for d in job.domains if d not in served]
    if unknown:
        raise SystemExit(f"diagnose.domains: {unknown} not served by {where}; it serves {sorted(served)}")
    names = job.domains or list(served)
    return [(d, job.adapter, None) if job.adapter else (d, *served[d]) for d in names]


def _print(name: str, rows: list[dict], requirement: float | None, job: DiagnoseJob, adapter: str) -> None:
    total = sum(r["correct"] for r in rows) / len(rows)
    verdict = "" if requirement is None else f" against {requirement:g}: {'MET' if total >= requirement else 'MISSED'}"
    base = " (its base alone, LoRA left out)" if job.base else ""
    print(f"\n{name} on {adapter}{base}: {total:.3f} over {len(rows)} {job.split} items{verdict}")
    table = []
    for group, g in sorted(by_group(rows).items(), key=lambda kv: -kv[1]["items"]):
        table.append({"group": group, "items": g["items"], "score": f"{g['score']:.3f}",
                      "lost": f"{g['items'] * (1 - g['score']) / len(rows):.3f}",  # points of the total it costs
                      "error / |error|": f"{g['mean_error']:+.2f} / {g['mean_abs_error']:.2f}" if "mean_error" in g else "-",
                      "commonest misses (truth -> answer)": ", ".join(f"{p} x{k}" for p, k in g["wrong"]) or "-"})
    print(format_table(table))


def run(cfg: DictConfig) -> dict:
    from train.data import load_domain

    job = to_dataclass(DiagnoseJob, cfg.diagnose)
    report, out_rows, loaded = {}, [], {}
    for name, adapter, requirement in _jobs(job):
        if adapter not in loaded:  # a fused adapter serves several domains: load it once
            loaded.clear()
            loaded[adapter] = adapter_on_base(adapter, job.model, lora=not job.base, device=job.device)
        vlm, state = loaded[adapter]
        task = state.domains[name].get("task")
        if task not in TALLIED:
            if job.domains:
                raise SystemExit(f"domain {name!r} is a {task} domain; vlora diagnose tallies {TALLIED} domains")
            print(f"\n{name}: a {task} domain, not tallied (its F1 is in the fusion report)")
            continue
        data = load_domain(state.domains[name].get("dataset") or Path(job.datasets) / name)
        rows = item_rows(vlm, state, data, job)
        _print(name, rows, requirement, job, adapter)
        report[name] = {"score": sum(r["correct"] for r in rows) / len(rows), "items": len(rows),
                        "requirement": requirement, "groups": by_group(rows)}
        out_rows += [{"domain": name, **r} for r in rows]
    if job.out:
        Path(job.out).parent.mkdir(parents=True, exist_ok=True)
        Path(job.out).write_text("".join(json.dumps(r, default=str) + "\n" for r in out_rows))
        print(f"\nevery item: {job.out}")
    return report
