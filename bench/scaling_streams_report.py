"""The scaling streams workload's saved setups and report: per setup (model, TP size, GPUs) the cameras
within target, per GPU and the efficiency against one GPU's of the same model, the replicas' adapter
loads, the tp setup's load time, memory and communication share, and the kill point's loss, spike and
recovery. Writes streams_scaling.csv (every point), streams_scaling_setups.csv (a row per setup),
streams_kill.csv (the kill's per-second p95), streams_scaling.json and streams_scaling.md, and prints
the table."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .results import write_csv, write_json

COLUMNS = ("setup", "model", "tp", "gpus", "point", "streams", "pass", "sent", "done", "unfinished", "errors",
           "p50_ms", "p95_ms", "p99_ms", "chunks_per_s", "served_per_s", "retried", "failed", "lost", "spike_p95_ms",
           "recovery_s")
KILL_COLUMNS = ("setup", "gpus", "streams", "second", "chunks", "p95_ms", "max_ms")
SETUP_COLUMNS = ("setup", "model", "tp", "gpus", "cameras", "cameras_per_gpu", "efficiency", "bounded", "complete",
                 "p95_ms_at_cameras", "load_s", "chunk_comm_share", "decode_comm_share", "replicas_per_adapter",
                 "adapter_loads", "device", "date")


def saved_whole(path: Path, model: str) -> bool:
    """Whether `path` holds a setup measured to its end for `model` (files from before those fields: yes)."""
    if not path.is_file():
        return False
    meta = json.loads(path.read_text())["meta"]
    return meta.get("complete", True) and (_model(meta) or model) == model


def _model(meta: dict) -> str | None:
    """A saved setup's model (files from before meta carried it: its job's)."""
    return meta.get("model", meta.get("job", {}).get("model"))


def measured_cameras(path: Path) -> int | None:
    """The largest passing camera count saved in a setup's file (None: not measured)."""
    if not path.is_file():
        return None
    return max((r["streams"] for r in json.loads(path.read_text())["rows"] if r["point"] == "warm" and r["pass"]),
               default=0)


def load_saved(out: Path, job) -> list[tuple[dict, list[dict]]]:
    """(meta, rows) of every setup saved under out, in run order."""
    saved = []
    counts = sorted({1, 2, 4, 8} | set(job.gpus))
    tp = [("tp", g) for g in sorted({2, 4, 8, job.tp_size})]
    for setup, gpus in [("single", 1)] + tp + [("replicas", g) for g in counts] + [("kill", g) for g in counts]:
        path = out / f"streams_{setup}_{gpus}.json"
        if path.is_file():
            data = json.loads(path.read_text())
            saved.append((data["meta"], data["rows"]))
    return saved


def summarize(saved: list[tuple[dict, list[dict]]]) -> dict:
    """setup label -> cameras within target, per GPU, efficiency, adapter loads; and the kill point."""
    setups, kill = {}, None
    for meta, rows in saved:
        kill = next((dict(r) for r in rows if r["point"] == "kill"), kill)
        if meta["setup"] == "kill":
            continue
        search = [r for r in rows if r["point"] == "warm"]
        passing = [r["streams"] for r in search if r["pass"]]
        cameras = max(passing, default=0)
        last = max((r for r in search if r["streams"] == cameras), key=lambda r: r["streams"], default=None)
        label = f"{meta['setup']}-{meta['gpus']}"
        profile = meta.get("profile") or {}
        decode = [d for d in profile.get("decode", []) if "comm_share" in d]
        setups[label] = {"setup": meta["setup"], "model": _model(meta),
                         "tp": meta.get("tp", 1), "gpus": meta["gpus"], "cameras": cameras,
                         "complete": meta.get("complete", True), "profile": profile or None,
                         "chunk_comm_share": (profile.get("chunk") or {}).get("comm_share"),
                         "decode_comm_share": decode[-1]["comm_share"] if decode else None,
                         "memory": meta.get("memory_built"),
                         "cameras_per_gpu": cameras / meta["gpus"], "bounded": any(not r["pass"] for r in search),
                         "p95_ms_at_cameras": last["p95_ms"] if last else math.nan, "load_s": meta.get("load_s"),
                         "wall_s": meta.get("wall_s"), "device": meta.get("device"), "date": meta.get("date"),
                         "adapter_loads": (search[-1].get("adapter_loads") if search else None),
                         "replicas_per_adapter": (search[-1].get("replicas_per_adapter") if search else None),
                         "chunks_by_replica": meta.get("by_replica")}
    if kill is not None:
        kill = {k: kill.get(k) for k in ("setup", "gpus", "streams", "sent", "done", "lost", "killed", "kill_error",
                                         "victim_held", "kill_at_s", "p95_before_ms", "spike_p95_ms", "recovery_s",
                                         "recovered", "retried", "failed", "p95_ms")}
    # against one GPU serving the same model (an out_dir may hold setups of several models)
    base = {s["model"]: s["cameras"] for s in setups.values() if s["setup"] == "single"}
    for s in setups.values():
        s["efficiency"] = s["cameras"] / (s["gpus"] * base[s["model"]]) if base.get(s["model"]) else math.nan
    return {"setups": setups, "kill": kill}


def report(job, out: Path) -> tuple[list[dict], dict]:
    saved = load_saved(out, job)
    rows = [r for _, rs in saved for r in rs]
    summary = {"target_ms": job.target_ms, **summarize(saved)}
    write_csv(out / "streams_scaling.csv", rows, COLUMNS, drop_extra=True)
    timeline = [{"setup": r["setup"], "gpus": r["gpus"], "streams": r["streams"], **t}
                for r in rows if r["point"] == "kill" for t in r.get("timeline", [])]
    write_csv(out / "streams_kill.csv", timeline, KILL_COLUMNS, drop_extra=True)
    write_csv(out / "streams_scaling_setups.csv", list(summary["setups"].values()), SETUP_COLUMNS, drop_extra=True)
    write_json(out / "streams_scaling.json", summary)
    text = markdown(summary, timeline)
    (out / "streams_scaling.md").write_text(text)
    print(text)
    return rows, summary


def _efficiency(value: float) -> str:
    # a model measured on no single GPU (the 72B at TP=2) has nothing to scale against: say so, not "nan"
    return "no one-GPU run" if math.isnan(value) else f"{value:.2f}"


def markdown(summary: dict, timeline: list[dict]) -> str:
    target = summary["target_ms"]
    lines = [f"# Cameras within {target:g} ms p95: one GPU, replicas, tensor parallel", "",
             "| setup | model | TP | GPUs | cameras | per GPU | efficiency | replicas per adapter |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in summary["setups"].items():
        bound = "" if s["bounded"] else " (every count passed: a lower bound)"
        bound += "" if s["complete"] else " (cut short: the points measured)"
        lines.append(f"| {s['setup']} | {s['model']} | {s['tp']} | {s['gpus']} | {s['cameras']}{bound} | "
                     f"{s['cameras_per_gpu']:.1f} | {_efficiency(s['efficiency'])} | {s['replicas_per_adapter'] or ''} |")
    for name, s in summary["setups"].items():
        if s["setup"] == "tp":
            lines += ["", *tp_lines(s)]
    for name, s in summary["setups"].items():
        if s["adapter_loads"]:
            lines += ["", f"Adapter loads per replica ({name}): " + "; ".join(
                f"{replica}: {loads}" for replica, loads in s["adapter_loads"].items())]
    kill = summary["kill"]
    if kill:
        lines += ["", f"## A replica killed under load ({kill['streams']} cameras on {kill['gpus']} replicas)", ""]
        if kill.get("kill_error"):
            lines.append(f"The kill failed: {kill['kill_error']}")
        lines += [f"- chunks lost: {kill['lost']} of {kill['sent']} measured; the killed replica held "
                  f"{kill['victim_held']} request(s) when last asked; chunks sent again: {kill['retried']}",
                  f"- p95 before the kill: {kill.get('p95_before_ms', math.nan):.0f} ms; spike (max per-second p95 "
                  f"after): {kill['spike_p95_ms']:.0f} ms",
                  f"- back within {target:g} ms and staying there: "
                  + (f"{kill['recovery_s']:.0f} s after the kill" if kill["recovered"] else "not within the point"),
                  "", "| second from the kill | chunks sent | p95 ms | max ms |", "|---|---|---|---|"]
        lines += [f"| {t['second']} | {t['chunks']} | {t['p95_ms']:.0f} | {t['max_ms']:.0f} |" for t in timeline]
    return "\n".join(lines) + "\n"


def tp_lines(s: dict) -> list[str]:
    """The tp setup: its load, rank 0's memory, and where a chunk's and a decode step's time goes."""
    memory, profile = s.get("memory") or {}, s.get("profile") or {}
    lines = [f"## {s['model']} over {s['gpus']} GPUs (TP={s['tp']}): {s['cameras']} cameras within target "
             f"(p95 {s['p95_ms_at_cameras']:.0f} ms there)", "",
             f"- built and warm in {s['load_s'] or math.nan:.0f} s; rank 0 holds "
             f"{memory.get('rank0_param_gib', math.nan):.1f} GiB of parameters"
             + (f", peak {memory['rank0_peak_gib']:.1f} GiB after loading" if "rank0_peak_gib" in memory else "")]
    chunk = profile.get("chunk") or {}
    if "error" in profile:
        lines.append(f"- the profiles after the search failed: {profile['error']}")
    if "error" in chunk:
        lines.append(f"- the chunk's profile failed: {chunk['error']}")
    elif chunk:
        lines.append(f"- one chunk's head answer (tower, prefill, head): {chunk['span_us'] / 1e3:.1f} ms span, "
                     f"{chunk['busy_us'] / 1e3:.1f} ms busy, communication {chunk['comm_us'] / 1e3:.1f} ms = "
                     f"{chunk['comm_share']:.0%} of the span ({chunk['comm_of_busy']:.0%} of busy)")
    for d in profile.get("decode", []):
        if "error" in d:
            lines.append(f"- a decode step's profile failed: {d['error']}")
        else:
            lines.append(f"- decode step at batch {d['batch']} ({d['context']} tokens of context): "
                         f"{d['span_us'] / 1e3:.2f} ms span, NCCL {d['nccl_us'] / 1e3:.2f} ms = {d['comm_share']:.0%}")
    return lines
