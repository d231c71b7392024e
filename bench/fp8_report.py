"""The FP8 benchmark's output (bench/fp8.py): fp8.csv (every row, `section` first), fp8.json, and fp8.md,
a short side-by-side summary, also printed."""

from __future__ import annotations

import math
from pathlib import Path

from .fp8_gemm import gemm_lines
from .fp8_heads import heads_lines
from .fp8_profile import profile_lines
from .results import write_csv, write_json


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else ""
    return "" if v is None else str(v)


def _table(rows: list[dict], cols: tuple[str, ...]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return lines


def summary_lines(rows: list[dict], meta: dict) -> list[str]:
    job = meta["job"]
    if job.get("heads_only"):  # the heads section alone: no random-weight engines ran
        return [f"# FP8 against bf16 on trained adapters' heads ({meta['device']}, {meta['date']})", "",
                f"Command: `{job['command'] or 'run_fp8_bench'}`", *heads_lines(rows)]
    acc = [r for r in rows if r["section"] == "accuracy"]
    decode = {(r["precision"], r["batch"]): r for r in rows if r["section"] == "decode"}
    switch = {r["precision"]: r for r in rows if r["section"] == "switch"}
    lines = [f"# FP8 projections against bf16 ({job['model']}, {meta['device']}, {meta['date']})", "",
             f"{job['prompts']} prompts of ~{meta['prompt_len']} tokens, {job['output_tokens']} greedy tokens each; "
             f"adapter rank {job['rank']} on {', '.join(job['modules'])}. "
             f"Command: `{job['command'] or 'run_fp8_bench'}`",
             "", "## Accuracy (logits up to the first divergence)", ""]
    lines += _table(acc, ("precision", "adapter", "mode", "against", "logit_max_abs_err", "logit_rel_err",
                          "logit_mean_abs_err", "token_agreement", "diverged", "first_divergence_min",
                          "margin_median"))
    lines += ["", "## Decode step (ms)", ""]
    decode_rows = []
    optional = [p for p in dict.fromkeys(q for q, _ in decode) if p not in ("fp32", "bf16", "fp8")]  # the A/B engines
    for b in job["batch_sizes"]:
        bf, f8 = decode.get(("bf16", b), {}), decode.get(("fp8", b), {})
        row = {"batch": b, "bf16_step": bf.get("decode_step_ms"), "fp8_step": f8.get("decode_step_ms"),
               "bf16_wall": bf.get("decode_wall_ms"), "fp8_wall": f8.get("decode_wall_ms"),
               **{f"{p}_step": decode.get((p, b), {}).get("decode_step_ms") for p in optional}}
        for kind in ("step", "wall"):
            bf_ms, f8_ms = row[f"bf16_{kind}"], row[f"fp8_{kind}"]
            if bf_ms is not None and f8_ms is not None and math.isfinite(bf_ms + f8_ms) and f8_ms > 0:
                row[f"{kind}_speedup"] = bf_ms / f8_ms
        decode_rows.append(row)
    extra = tuple(f"{p}_step" for p in optional)
    lines += _table(decode_rows, ("batch", "bf16_step", "fp8_step", *extra, "step_speedup", "bf16_wall", "fp8_wall",
                                  "wall_speedup"))
    if meta.get("decode_activations"):
        kind = {"bf16": "bf16 activations as they are (weight-only)", "fp8": "per-token FP8 activations"}
        lines += ["", f"fp8's decode GEMMs (1-64 tokens) take {kind[meta['decode_activations']]}"
                  + ("; fp8_w8a16's take bf16 ones as they are" if "fp8_w8a16_step" in extra else "")]
    if meta.get("gemm_pdl") is not None:
        how = "launched with PDL behind their producers, their weight prefetched" if meta["gemm_pdl"] else \
            "launched after their producers end"
        lines += ["", f"fp8's decode GEMMs are {how}"
                  + ("; fp8_no_gemm_pdl's after their producers end" if "fp8_no_gemm_pdl_step" in extra else "")]
    if meta.get("decode_splits"):
        splits = meta["decode_splits"]
        how = "contexts split to fill the GPU (decode_splits)" if splits == "auto" else f"VLORA_DECODE_SPLITS={splits}"
        lines += ["", f"decode attention: {how}"]
    lines += ["", "## Weights and switches", ""]
    lines += _table(list(switch.values()), ("precision", "projection_bytes", "merge_saved_bytes", "method", "merge_ms",
                                            "unmerge_ms", "switch_ms", "restore_exact", "max_drift_after_switches"))
    if "bf16" in switch and "fp8" in switch and switch["bf16"]["switch_ms"] > 0:
        ratio = switch["fp8"]["switch_ms"] / switch["bf16"]["switch_ms"]
        lines += ["", f"fp8 switch / bf16 switch = {ratio:.2f} (target <= 1.5: {'met' if ratio <= 1.5 else 'missed'})"]
    return lines + profile_lines(rows) + gemm_lines(rows, meta.get("layers", 0)) + heads_lines(rows)


def write_report(rows: list[dict], meta: dict, out: Path) -> None:
    write_csv(out / "fp8.csv", rows)
    write_json(out / "fp8.json", {"meta": meta, "rows": rows})
    lines = summary_lines(rows, meta)
    (out / "fp8.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
