"""The tensor-parallel benchmark's output (bench/tp.py): tp.csv (every row, `section` first), tp.json
(meta and rows: what a resumed run reads back) and tp.md, the tables, printed at the end."""

from __future__ import annotations

import math
from pathlib import Path

from .fp8_report import _table
from .results import write_csv, write_json

# job fields a resumed run must share with the rows it keeps
RESUME_KEYS = ("shape", "device", "dtype", "prompts", "prompt_tokens", "image_size", "output_tokens", "adapters",
               "rank", "modules", "decode_context", "decode_tokens", "vision_images", "seed")
DECODE_TARGET = 0.65  # TP=2 decode step at batch 32 over one GPU's (issue 49)
PARITY_COLS = ("tp", "mode", "against", "logit_max_abs_err", "logit_mean_abs_err", "token_agreement", "prompts",
               "diverged", "first_divergence_min", "margin_min", "margin_median")


def gpu_command(job: dict) -> str:
    """The command line of the committed 2-GPU result."""
    return ("timeout 540 python -m vlora bench bench.suite=tp bench.tp.sizes=[2] bench.tp.shape=7b "
            f"bench.tp.batches=[1,32,64] bench.tp.budget_s={job.get('budget_s', 480):g} bench.out_dir=$OUT/tp")


def _ratio(a, b):
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return None
    return a / b


def _by(rows: list[dict], section: str) -> list[dict]:
    return [r for r in rows if r["section"] == section]


def _timing_lines(rows: list[dict], sizes: list[int]) -> list[str]:
    decode = {(r["tp"], r["batch"]): r for r in _by(rows, "decode")}
    lines = ["", "## Decode step (ms; step = CUDA-graph replay + LM head, device time; wall = engine step)", ""]
    table = []
    for b in sorted({b for _, b in decode}):
        one = decode.get((1, b), {})
        for tp in sizes:
            r = decode.get((tp, b), {})
            table.append(dict(batch=b, tp=tp, tp1_step=one.get("decode_step_ms"), step=r.get("decode_step_ms"),
                              step_ratio=_ratio(r.get("decode_step_ms"), one.get("decode_step_ms")),
                              tp1_wall=one.get("decode_wall_ms"), wall=r.get("decode_wall_ms"),
                              wall_ratio=_ratio(r.get("decode_wall_ms"), one.get("decode_wall_ms"))))
    lines += _table(table, ("batch", "tp", "tp1_step", "step", "step_ratio", "tp1_wall", "wall", "wall_ratio"))
    for r in table:
        ratio = r["step_ratio"] if r["step_ratio"] is not None else r["wall_ratio"]
        if r["batch"] == 32 and ratio is not None:
            kind = "step" if r["step_ratio"] is not None else "wall (no CUDA graphs here)"
            target = (f" (target <= {DECODE_TARGET}: {'met' if ratio <= DECODE_TARGET else 'missed'})"
                      if r["tp"] == 2 else "")
            lines += ["", f"TP={r['tp']} / TP=1 decode {kind} at batch 32 = {ratio:.3f}{target}"]
    got = {r["tp"]: r for r in _by(rows, "prefill")}
    if got:
        one = got.get(1, {}).get("prefill_ms")
        table = [dict(r, ratio=_ratio(r["prefill_ms"], one)) for _, r in sorted(got.items())]
        lines += ["", "## Prefill of the prompts with images (wall ms)", ""]
        lines += _table(table, ("tp", "prompts", "prompt_tokens", "prefill_ms", "ratio"))
    lines += _vision_lines(rows)
    prof = _by(rows, "profile")
    if prof:
        lines += ["", "## Communication share of a decode step (rank 0, torch.profiler: NCCL kernels over the "
                      "step's span, waits for the other ranks included)", ""]
        lines += _table(prof, ("tp", "batch", "span_us", "busy_us", "nccl_us", "comm_share"))
    return lines


def _vision_mode(row: dict) -> str:
    return row.get("tp_vision") or ("whole" if row["tp"] == 1 else "split")  # rows from before the modes


def _vision_lines(rows: list[dict]) -> list[str]:
    """The encoder per TP size and tower mode against TP=1, the split one's per-rank breakdown and its
    profiled call."""
    vision = sorted(_by(rows, "vision"), key=lambda r: (r["tp"], _vision_mode(r) != "split"))
    if not vision:
        return []
    one = next((r["vision_ms"] for r in vision if r["tp"] == 1), None)
    table = [dict(r, tp_vision=_vision_mode(r), ratio=_ratio(r["vision_ms"], one)) for r in vision]
    lines = ["", "## Vision encoder (ms; tp_vision: split = each rank its share of the items, then one "
                 "all-gather; whole = every rank every item)", ""]
    lines += _table(table, ("tp", "tp_vision", "images", "items", "items_here", "vision_tokens", "vision_ms", "ratio"))
    split = [r for r in table if "tower_ms" in r]
    if split:
        lines += ["", "Split, per rank (medians of 3 calls, ms): on rank 0 the call's start to its tower pass's end "
                      "(device), that end to the all-gather's end (transfer + waiting for a later rank), the call's host "
                      "time and the host time until its tower pass was launched; gather_min: the all-gather's own time "
                      "(the last rank to reach it); the slowest other rank's tower and host times", ""]
        lines += _table(split, ("tp", "tower_ms", "gather_ms", "host_ms", "host_tower_ms", "gather_min_ms",
                                "peer_tower_ms", "peer_host_ms", "peer_host_tower_ms"))
    prof = _by(rows, "vision_profile")
    if prof:
        lines += ["", "Profiled call on rank 0 (us; torch.profiler, the split tower on a group): the tower's kernels, "
                      "the all-gather's (waits for the other ranks included), idle = span - both; the longest "
                      "tower kernels (ms)", ""]
        lines += _table(prof, ("tp", "tp_vision", "what", "span_us", "tower_us", "comm_us", "idle_us", "top_tower_ms"))
    return lines


def summary_lines(rows: list[dict], meta: dict) -> list[str]:
    job = meta["job"]
    sizes = list(job["sizes"])
    where = f"{meta['device']} x{meta['gpus']}" if meta["gpus"] else meta["device"]
    lines = [f"# Tensor parallel against one {'GPU' if meta['gpus'] else 'process'} ({meta['model']}, "
             f"{job['dtype']}, {where}, {meta['date']})", "",
             f"{job['prompts']} prompts of ~{meta.get('prompt_len', '?')} tokens (text + one {job['image_size']}px "
             f"image), {job['output_tokens']} greedy tokens each; {job['adapters']} random adapters of rank "
             f"{job['rank']} on {len(job['modules'])} projections. Command: `{job['command'] or 'run_tp_bench'}`",
             "", "## Parity: TP=N against TP=1 (logits up to the first divergence)", ""]
    lines += _table(_by(rows, "parity"), PARITY_COLS)
    noise = _by(rows, "noise")
    if noise:
        lines += ["", f"## {job['dtype']} noise: each run against a float32 TP=1 engine (same sequence)", ""]
        lines += _table(noise, PARITY_COLS)
    div = [r for r in _by(rows, "parity") + noise if r.get("divergences")]
    if div:
        lines += ["", "Divergences (prompt@token (TP=1 / reference margin there)):", ""]
        lines += [f"- TP={r['tp']} {r['mode']} vs {r['against']}: {r['divergences']}" for r in div]
    lines += _timing_lines(rows, sizes)
    if meta.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in meta["notes"]]
    seconds = meta.get("seconds", {})
    if seconds:
        lines += ["", "Seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items())]
    return lines


def write_report(rows: list[dict], meta: dict, out: Path, echo: bool) -> None:
    write_csv(out / "tp.csv", rows)
    write_json(out / "tp.json", {"meta": meta, "rows": rows})
    lines = summary_lines(rows, meta)
    (out / "tp.md").write_text("\n".join(lines) + "\n")
    if echo:
        print("\n".join(lines))
        print(f"\nOn a machine with 2 GPUs:\n  {gpu_command(meta['job'])}", flush=True)
