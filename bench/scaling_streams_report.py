"""The scaling streams workload's report: per setup the cameras within target, per GPU and the
efficiency against one GPU's, the replicas' adapter loads, and the kill point's loss, spike and
recovery. Writes streams_scaling.csv (every point), streams_scaling_setups.csv (a row per setup),
streams_kill.csv (the kill's per-second p95), streams_scaling.json and streams_scaling.md, and prints
the table."""

from __future__ import annotations

import math
from pathlib import Path

from .results import write_csv, write_json

COLUMNS = ("setup", "gpus", "point", "streams", "pass", "sent", "done", "unfinished", "errors", "p50_ms", "p95_ms",
           "p99_ms", "chunks_per_s", "served_per_s", "retried", "failed", "lost", "spike_p95_ms", "recovery_s")
KILL_COLUMNS = ("setup", "gpus", "streams", "second", "chunks", "p95_ms", "max_ms")
SETUP_COLUMNS = ("setup", "gpus", "cameras", "cameras_per_gpu", "efficiency", "bounded", "p95_ms_at_cameras",
                 "replicas_per_adapter", "adapter_loads", "device", "date")


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
        setups[label] = {"setup": meta["setup"], "gpus": meta["gpus"], "cameras": cameras,
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
    base = setups.get("single-1", {}).get("cameras")
    for s in setups.values():
        s["efficiency"] = s["cameras"] / (s["gpus"] * base) if base else math.nan
    return {"setups": setups, "kill": kill}


def report(job, out: Path) -> tuple[list[dict], dict]:
    from .scaling_streams import load_saved

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


def markdown(summary: dict, timeline: list[dict]) -> str:
    target = summary["target_ms"]
    lines = [f"# Cameras within {target:g} ms p95: one GPU and replicas", "",
             "| setup | GPUs | cameras | per GPU | efficiency | replicas per adapter |", "|---|---|---|---|---|---|"]
    for name, s in summary["setups"].items():
        bound = "" if s["bounded"] else " (every count passed: a lower bound)"
        lines.append(f"| {s['setup']} | {s['gpus']} | {s['cameras']}{bound} | {s['cameras_per_gpu']:.1f} | "
                     f"{s['efficiency']:.2f} | {s['replicas_per_adapter'] or ''} |")
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
