"""The offline stage's report: per domain, the accuracy of the base model answering zero-shot,
of the teacher (against the world's truth), of one adapter per domain, of one adapter for
everything, and of the fused adapters, with the number of adapters each way; plus the
head-versus-LM-head comparison of the paper (one domain answered by its head after one
prefill, and by an adapter trained to write the answer, decoded token by token).

Every accuracy except the teacher's is measured on the domain's eval split against the
teacher's labels (what the adapters learn from), with the domain's own metric.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from fusion import fuse
from fusion.confidence import requirement_within, score_interval
from train.baselines import baseline_cell, beats_cell
from train.data import teacher_agreement
from train.evaluate import lm_view
from train.zero_shot import first_items_score

from .fusion import print_event
from .table import format_table


def head_vs_lm(trainer, data) -> dict:
    """One domain two ways: its head (one prefill) vs an adapter decoding the answer text."""
    from train import evaluate

    tok = trainer.vlm.processor.tokenizer
    answer_tokens = [len(tok(r["answer"], add_special_tokens=False)["input_ids"]) + 1  # + end of turn
                     for r in data.splits["eval"]]
    decode_steps = sum(answer_tokens) / len(answer_tokens)
    with_head = trainer.train(trainer.new_adapter(900), data.name)
    head_acc = trainer.evaluate(with_head, data.name)
    view = lm_view(data)
    trainer._data[f"{data.name}__lm"] = dataclasses.replace(view, info=dataclasses.replace(view.info, name=f"{data.name}__lm"))
    with_lm = trainer.train(trainer.new_adapter(901), f"{data.name}__lm")
    trainer.vlm.load_lora_state(with_lm.lora)
    lm_acc = evaluate(trainer.vlm, None, trainer._data[f"{data.name}__lm"], max_new_tokens=trainer.cfg.max_new_tokens)
    return {"domain": data.name, "head_accuracy": round(head_acc, 3), "head_forward_passes": 1,
            "lm_head_accuracy": round(lm_acc["accuracy"], 3), "lm_head_forward_passes": round(1 + decode_steps, 2)}


def order_row(name: str, result, domains) -> dict:
    """One fusion of the domains, summed up: the order they were tried in, how many adapters came
    out, how many domains each holds on average, and whether every requirement was met."""
    where = {d: a for a in result.adapters for d in a.domains}
    missed = [d.name if d.name in where else f"{d.name} (rejected)" for d in domains
              if d.name not in where or where[d.name].accuracies[d.name] < d.requirement]
    placed = sum(d.name in where for d in domains)  # a rejected domain is in no adapter
    return {"order": name, "tried": " > ".join(d.name for d in result.order), "adapters": len(result.adapters),
            "domains_per_adapter": round(placed / len(result.adapters), 2) if result.adapters else 0.0,
            "groups": " | ".join("+".join(a.domains) for a in result.adapters),
            "all_met": not missed, "missed": ", ".join(missed) or "-"}


def build_report(cfg, fused: dict, trainer, log=None) -> dict:
    log = log or sys.stderr
    opts = cfg.offline
    result = fused["result"]
    order = [d for d in result.order]
    where = {d: a for a in result.adapters for d in a.domains}
    alone = {e.domain: e.accuracies[e.domain] for e in result.events
             if e.action in ("open", "alone_fails", "fuse_missed", "reject")}  # the steps that trained a domain alone
    refused = {e.domain: e for e in result.events if e.action == "reject"}
    rows, per_domain, all_in_one = [], {}, {}
    if opts.per_domain:
        for i, d in enumerate(order):
            if d.name not in alone:
                state = trainer.train(trainer.new_adapter(500 + i), d)
                alone[d.name] = trainer.evaluate(state, d)
        per_domain = alone
    if opts.all_in_one:
        state = trainer.new_adapter(700)
        for d in order:
            state = trainer.train(state, d)
        all_in_one = {d.name: trainer.evaluate(state, d) for d in order}
    for d in order:
        data = trainer.dataset(d.name)
        base = None
        zero_shot = getattr(trainer, "zero_shot", None)  # None: train.zero_shot_baseline=false
        if int(opts.base_eval_limit) > 0 and zero_shot is not None:  # 0: skip the column
            # the zero-shot baseline's answers (cached per base and eval split), read as served answers are
            record = zero_shot.record(trainer.vlm, data)
            base = first_items_score(d.task, record, int(opts.base_eval_limit))
        teacher = teacher_agreement(data.path)
        row = {"domain": d.name, "task": d.task, "requirement": d.requirement,
               "teacher_vs_truth": teacher, "base_zero_shot": None if base is None else round(base, 3),
               "one_adapter_per_domain": round(per_domain[d.name], 3) if per_domain else None,
               "one_adapter_for_all": round(all_in_one[d.name], 3) if all_in_one else None}
        if d.name in refused:
            rows.append(rejected_row(row, refused[d.name], data.size("eval")))
        else:
            adapter = where[d.name]
            verdict = adapter.baselines.get(d.name)
            shot = ((getattr(adapter.state, "accuracies", None) or {}).get(d.name) or {}).get("baselines") or {}
            rows.append({**row, "fused": round(adapter.accuracies[d.name], 3),
                         # beside the score: what always answering the most common training label scores
                         "majority": baseline_cell(verdict), "beats_majority": beats_cell(verdict),
                         # and the base model's own answers to the same items, by the same test
                         "beats_zero_shot": beats_cell(shot.get("zero_shot")),
                         # the base's score on the items fusion evaluated, where the column was not measured apart
                         "base_zero_shot": row["base_zero_shot"] if row["base_zero_shot"] is not None or not
                         shot.get("zero_shot") else round(shot["zero_shot"]["accuracy"], 3),
                         "eval_items": data.size("eval"),
                         "fused_95": score_interval(d.task, adapter.accuracies[d.name], data.size("eval")),
                         "fused_adapter": adapter.name,
                         # the fused adapter's agreement with its teacher, over the teacher's with the truth
                         "fused_of_teacher": round(adapter.accuracies[d.name] / teacher, 3) if teacher else None,
                         "meets_requirement": adapter.accuracies[d.name] >= d.requirement})
        print(f"[report] {d.name}: base {'-' if base is None else f'{base:.2f}'}, fused "
              f"{'-' if rows[-1]['fused'] is None else format(rows[-1]['fused'], '.2f')}", file=log, flush=True)
    label = lambda o: f"{o} (seed {cfg.seed})" if o == "seeded" else o  # noqa: E731
    orders = [order_row(label(fused.get("order", "size_desc")), result, order)]
    for other in opts.get("other_orders") or []:  # the same domains fused again, tried in another order
        print(f"[report] fusing again in {label(other)} order", file=log, flush=True)
        again = fuse(order, trainer, order=other, seed=int(cfg.seed), progress=print_event,
                     place_missed=fused.get("place_missed", "best"),
                     refuse_at_baseline=not fused.get("accept_at_baseline", False))
        orders.append(order_row(label(other), again, order))
    comparison = None
    if opts.compare_lm_head and opts.compare_lm_head in {d.name for d in order}:
        comparison = head_vs_lm(trainer, trainer.dataset(opts.compare_lm_head))
    counts = adapter_counts(opts, len(order), len(result.adapters))
    why_empty = {
        "base_zero_shot": None if int(opts.base_eval_limit) > 0 and getattr(trainer, "zero_shot", None) else
        "the base model's zero-shot answers were not measured (offline.base_eval_limit=0 or "
        "train.zero_shot_baseline=false)",
        "beats_zero_shot": "zero-shot: not measured (train.zero_shot_baseline=false, or evaluations from before "
        "it); or no adapter (REJECTED)",
        "one_adapter_per_domain": None if opts.per_domain else
        "no adapter per domain was trained for comparison (offline.per_domain=false)",
        "one_adapter_for_all": None if opts.all_in_one else
        "no single adapter for all domains was trained for comparison (offline.all_in_one=false)",
        "teacher_vs_truth": "the domain's dataset records no teacher-vs-truth agreement (its data has no ground truth)",
        "fused_of_teacher": "no teacher-vs-truth agreement to compare with, or no adapter (REJECTED)",
        "fused_95": "detect scores F1, which is no share of items: no binomial interval; or no adapter (REJECTED)",
        "fused": "fusion rejected the domain (its REJECTED line says why): no adapter serves it",
        "majority": "detect scores F1, which is no share of items: no majority baseline",
        "beats_majority": "detect scores F1, which is no share of items: no majority baseline"}
    return {"model": fused["model"].name, "domains": rows, "adapters": counts, "orders": orders,
            "head_vs_lm_head": comparison,
            "train_calls": trainer.train_calls, "manifest": fused["manifest"],
            "not_measured": not_measured(rows, why_empty)}


def rejected_row(row: dict, event, eval_items: int) -> dict:
    """The report row of a domain fusion refused: its score alone beside its majority baseline, and
    no fused adapter; `rejected` says why (a line under the table, not a column)."""
    from fusion.spec import baseline_reason

    verdict = event.baselines[event.domain]
    return {**row, "fused": None, "majority": baseline_cell(verdict), "beats_majority": beats_cell(verdict),
            "beats_zero_shot": None,
            "eval_items": eval_items, "fused_95": None, "fused_adapter": "REJECTED", "fused_of_teacher": None,
            "meets_requirement": False,
            "rejected": f"{event.accuracies[event.domain]:.3f} alone, {baseline_reason(verdict)}"}


def adapter_counts(opts, domains: int, fused: int) -> dict[str, int]:
    """How many adapters each way, for the comparisons that were trained (offline.per_domain,
    offline.all_in_one) and the fusion: a comparison not trained has no count."""
    return {**({"one_adapter_per_domain": domains} if opts.per_domain else {}),
            **({"one_adapter_for_all": 1} if opts.all_in_one else {}), "fused": fused}


def not_measured(rows: list[dict], why_empty: dict[str, str | None]) -> dict[str, str]:
    """Why each column holds no number, for the columns where some row holds none: a column
    measured in every row is not listed, whatever reason it could have had."""
    empty = {col for r in rows for col, value in r.items() if value is None}
    return {col: why for col, why in why_empty.items() if why and col in empty}


MISSED = "MISSED"  # the marker of a domain whose fused adapter misses its requirement


def explained_table(rows: list[dict], reasons: dict[str, str], default: str = "not measured") -> tuple[str, list[str]]:
    """The table of `rows` with every None cell shown as "-[n]", and the footnotes "[n] column: why"
    (from `reasons` per column, else `default`)."""
    notes: dict[str, int] = {}
    shown = []
    for r in rows:
        row = {}
        for col, value in r.items():
            if value is None:
                n = notes.setdefault(col, len(notes) + 1)
                value = f"-[{n}]"
            row[col] = value
        shown.append(row)
    return format_table(shown), [f"[{n}] {col}: {reasons.get(col, default)}" for col, n in notes.items()]


def domain_lines(report: dict) -> list[str]:
    """The per-domain table, each missed requirement marked in it and said in a line under it, and
    the footnotes of the cells that were not measured."""
    rows = report.get("domains") or []
    if not rows:
        return []
    missed = [r for r in rows if r.get("meets_requirement") is False and not r.get("rejected")]
    shown = [{**{k: v for k, v in r.items() if k != "rejected"},
              "meets_requirement": MISSED if r.get("meets_requirement") is False else r.get("meets_requirement")}
             for r in rows]
    table, notes = explained_table(shown, report.get("not_measured") or {})
    lines = ["```", table, "```"]
    lines += [f"REJECTED: {r['domain']} {r['rejected']}: fusion gave it no adapter, so routing serves it from the "
              "base model" for r in rows if r.get("rejected")]
    for r in missed:
        lines.append(f"{MISSED}: {r['domain']} fused {r['fused']} < requirement {r['requirement']} "
                     f"(adapter {r['fused_adapter']}); routing skips that adapter for {r['domain']} and falls back "
                     "to the next adapter that meets it, else the base model")
    if not missed and not any(r.get("rejected") for r in rows):
        lines.append(f"Every domain meets its requirement ({len(rows)} domains).")
    for r in rows:  # a fused score no better than always answering the majority (kept: fusion.accept_at_baseline)
        if (r.get("beats_majority") or "").startswith("NO") and not r.get("rejected"):
            lines.append(f"NO BETTER THAN MAJORITY: {r['domain']} fused {r['fused']} against {r['majority']} "
                         f"({r['beats_majority']}); its adapter shows no knowledge beyond the label counts")
    for r in rows:  # a fused score no better than the base model answering alone (zero-shot)
        if (r.get("beats_zero_shot") or "").startswith("NO") and not r.get("rejected"):
            lines.append(f"NO BETTER THAN ZERO-SHOT: {r['domain']} fused {r['fused']} against the base model's "
                         f"{r.get('base_zero_shot')} ({r['beats_zero_shot']}); its adapter adds nothing the base "
                         "does not answer alone")
    for r in rows:  # a verdict that another draw of the eval items could turn
        lo_hi = r.get("fused_95")
        if requirement_within(lo_hi, r["requirement"]):
            lines.append(f"NEAR: {r['domain']} fused {r['fused']}, 95% interval {lo_hi} over {r['eval_items']} eval "
                         f"items, holds its requirement {r['requirement']}: another draw of eval items could turn "
                         f"the verdict ({'met' if r.get('meets_requirement') else 'missed'} here)")
    return lines + notes


def write_report(report: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Offline stage report ({report['model']})", "", *domain_lines(report), "",
             "Adapters: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in report["adapters"].items())
             + ("" if len(report["adapters"]) > 1 else " (no comparison was trained)")]
    if report.get("orders"):
        lines += ["", "Fusion by the order domains are tried in (same domains and requirements):", "```",
                  format_table([{k: v for k, v in r.items() if k != "tried"} for r in report["orders"]]), "```"]
    if report["head_vs_lm_head"]:
        lines += ["", "Head vs LM head:", "```", format_table([report["head_vs_lm_head"]]), "```"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    _plot(report, out / "report.png")
    return out


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["domains"]
    cols = [("base_zero_shot", "base, zero-shot"), ("teacher_vs_truth", "teacher vs truth"),
            ("one_adapter_per_domain", f"1 adapter per domain ({report['adapters'].get('one_adapter_per_domain')})"),
            ("one_adapter_for_all", "1 adapter for all"), ("fused", f"fused ({report['adapters']['fused']} adapters)")]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 3.6))
    width = 0.8 / len(cols)
    for k, (key, label) in enumerate(cols):
        xs = [i + k * width for i, r in enumerate(rows) if r[key] is not None]  # not measured: no bar
        if not xs:  # a comparison that was not trained has no legend entry either
            continue
        ax.bar(xs, [r[key] for r in rows if r[key] is not None], width, label=label)
    ax.scatter([i + 0.4 - width / 2 for i in range(len(rows))], [r["requirement"] for r in rows], marker="_",
               s=400, color="black", label="requirement", zorder=3)
    missed = [i for i, r in enumerate(rows) if r.get("meets_requirement") is False and r["fused"] is not None]
    if missed:
        ax.scatter([i + 4 * width for i in missed], [rows[i]["fused"] + 0.04 for i in missed], marker="x",
                   color="red", s=60, label="fused misses requirement", zorder=4)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [r["domain"] for r in rows], rotation=20)
    ax.set_ylabel("accuracy (domain metric)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
