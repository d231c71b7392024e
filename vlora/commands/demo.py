"""`vlora demo`: the main job on the built-in default, end to end.

1. the offline stage (`vlora offline`): the tiny zoo model and its world pretraining, the
   teachers, one distilled dataset per knowledge domain, knowledge fusion into adapters with
   task heads (every step cached: a second run reuses them);
2. the server (`vlora serve`) on that model with the fused adapters, the orchestrator's policy
   and the RPyC service, in this process;
3. several synthetic camera feeds (`vlora video_analytics`) and a batch of retrieval queries
   (`vlora visual_retrieval`) through the client library, at the same time as each other's load;
4. a report per stream and task (accuracy against the world's truth, latency percentiles,
   drops), per retrieval kind, and of the engine (mode switches, adapters), as JSON, Markdown
   and a plot.

Each stage is composed from its own primary config (conf/offline.yaml, serve.yaml,
video_analytics.yaml, visual_retrieval.yaml) with the overrides listed under `demo:`, so the
same run on a GPU with a real checkpoint is a matter of config values.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..config import compose
from .offline_report import domain_lines, explained_table

# why a cell of the stream and retrieval tables holds no number
STREAM_REASONS = {"accuracy": "no ground truth on this source (only the synthetic world carries it)",
                  "agreement": "no shadow teacher on this stream and task, or it compared no chunk yet",
                  "compared": "no shadow teacher on this stream and task",
                  "p50_ms": "no chunk answered", "p95_ms": "no chunk answered", "p99_ms": "no chunk answered"}
RETRIEVAL_REASONS = {"accuracy": "no query of this kind had a known answer",
                     "p50_ms": "no query of this kind was answered", "p95_ms": "no query of this kind was answered"}


PROFILES = ("auto", "cpu", "gpu")


def resolve_profile(profile: str) -> str:
    """cpu or gpu: `auto` is gpu where CUDA is available."""
    if profile not in PROFILES:
        raise ValueError(f"demo.profile={profile!r}: use one of {list(PROFILES)}")
    if profile == "auto":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    return profile


def stage_overrides(d: DictConfig, profile: str, stage: str) -> list[str]:
    """The overrides of one stage: the demo's own list, then the GPU profile's (resolved here, so
    an interpolation like ${oc.env:VLORA_HOME} reads this process's environment)."""
    def listed(node) -> list[str]:
        return list(OmegaConf.to_container(node, resolve=True)) if node else []

    return listed(d.get(stage)) + (listed(d.gpu.get(stage)) if profile == "gpu" else [])


def _stage(name: str, overrides, seed: int, extra: list[str] = ()) -> DictConfig:
    return compose(name, [f"seed={seed}", *list(overrides or []), *extra])


def _stream_rows(va: dict) -> list[dict]:
    """A row per stream and task; agreement with a shadow teacher (and chunks compared) where any is set."""
    rows = []
    shadowed = any("shadow" in t for s in va["streams"].values() for t in s["tasks"].values())
    for name, s in va["streams"].items():
        for task, t in s["tasks"].items():
            route = s["routes"][task]
            lat = t["latency_ms"]
            rows.append({"stream": name, "task": task,
                         "route": f"{route['adapter'] or 'base'}/{route['output_mode']}",
                         "chunks": s["chunks_processed"], "dropped": s["chunks_dropped"],
                         "p50_ms": lat["p50"], "p95_ms": lat["p95"], "p99_ms": lat["p99"],
                         "accuracy": None if t["accuracy"] is None else round(t["accuracy"], 3)})
            if shadowed:
                rows[-1].update(agreement=(t.get("shadow") or {}).get("agreement"),
                                compared=(t.get("shadow") or {}).get("compared"))
    return rows


def _retrieval_rows(vr: dict) -> list[dict]:
    rows = []
    for kind, k in (vr.get("by_kind") or {}).items():
        lat = k.get("latency_ms") or {}
        rows.append({"kind": kind, "queries": k["queries"], "errors": k["errors"], "accuracy": k["accuracy"],
                     "p50_ms": lat.get("p50"), "p95_ms": lat.get("p95")})
    return rows


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, kinds = report["streams"], report.get("retrieval") or []
    if not rows and not kinds:
        return
    labels = [f"{r['stream']}\n{r['task']}" for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(max(10, 1.6 * (len(rows) + len(kinds))), 3.4))
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["p50_ms"] or 0 for r in rows], 0.4, label="p50")
    ax1.bar([i + 0.2 for i in x], [r["p95_ms"] or 0 for r in rows], 0.4, label="p95")
    ax1.set_xticks(list(x), labels, fontsize=7)
    ax1.set_ylabel("chunk latency (ms)")
    ax1.legend(fontsize=7)
    ax2.bar(list(x), [r["accuracy"] or 0 for r in rows])
    ax2.set_xticks(list(x), labels, fontsize=7)
    ax2.set_ylabel("accuracy vs world truth")
    ax2.set_ylim(0, 1)
    # retrieval: accuracy per query kind (bars) and its p50 latency (on a second axis)
    xk = range(len(kinds))
    ax3.bar(list(xk), [k["accuracy"] or 0 for k in kinds], color="tab:green", label="accuracy")
    ax3.set_xticks(list(xk), [k["kind"] for k in kinds], fontsize=7, rotation=20)
    ax3.set_ylabel("retrieval accuracy")
    ax3.set_ylim(0, 1)
    ax3.set_title("visual retrieval", fontsize=8)
    lat = ax3.twinx()
    lat.plot(list(xk), [k["p50_ms"] or 0 for k in kinds], "o", color="black", label="p50 ms")
    lat.set_ylabel("p50 latency (ms)", fontsize=7)
    lat.set_ylim(bottom=0)
    for ax, values in ((ax2, [r["accuracy"] for r in rows]), (ax3, [k["accuracy"] for k in kinds])):
        for i, v in enumerate(values):
            if v is None:  # not measured (see the report's footnotes), not zero
                ax.text(i, 0.02, "n/a", ha="center", fontsize=7)
    fig.suptitle(f"V-LoRA demo: {report['model']}, {report['engine'].get('adapters', 0)} adapters", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report_lines(report: dict) -> list[str]:
    """The demo's Markdown report: the fused domains (every missed requirement flagged), the streams
    and the retrieval kinds, with a footnote for every cell that holds no number."""
    text = [f"# V-LoRA demo ({report['model']})", ""]
    if report.get("domains"):
        text += ["Offline stage (fused adapters per domain):", *domain_lines(report), ""]
    if report["streams"]:
        table, notes = explained_table(report["streams"], STREAM_REASONS)
        text += ["Video analytics:", "```", table, "```", *notes]
    if report["retrieval"]:
        table, notes = explained_table(report["retrieval"], RETRIEVAL_REASONS)
        text += ["", "Visual retrieval:", "```", table, "```", *notes]
    engine = report["engine"]
    text += ["", f"Engine: policy {engine['policy']}, {engine['adapters']} adapters, {engine['mode_switches']} mode "
                 f"switches ({engine['switch_ms_total']} ms), steps by mode {engine['steps_by_mode']}",
             f"Time: offline stage {report['seconds']['offline']} s, whole run {report['seconds']['total']} s"]
    return text


def run(cfg: DictConfig) -> dict:
    from . import offline, video_analytics, visual_retrieval, world
    from .serve import start_server

    d = cfg.demo
    seed, token = int(cfg.seed), str(d.token)
    profile = resolve_profile(str(d.profile))
    over = {stage: stage_overrides(d, profile, stage)
            for stage in ("offline", "world", "serve", "video_analytics", "visual_retrieval")}
    began = time.perf_counter()
    log = sys.stderr
    print(f"[demo 1/4] offline stage ({profile} profile): teachers, datasets, fusion", file=log, flush=True)
    offline_report = offline.run(_stage("offline", over["offline"], seed))
    model_path = offline_report["model_path"]
    world.run(_stage("world", over["world"], seed))  # the retrieval collection (kept when already written)
    t_offline = time.perf_counter() - began

    print(f"[demo 2/4] server on {model_path} with the fused adapters", file=log, flush=True)
    serve_cfg = _stage("serve", over["serve"], seed, [f"model.path={model_path}", f"rpc.token={token}"])
    server = start_server(serve_cfg, token, 16)
    connect = [f"server.port={server.port}", f"server.token={token}"]
    try:
        print("[demo 3/4] camera streams and retrieval queries through the client", file=log, flush=True)
        va_cfg = _stage("video_analytics", over["video_analytics"], seed, connect)
        vr_cfg = _stage("visual_retrieval", over["visual_retrieval"], seed, connect)
        results: dict = {}
        retrieval = threading.Thread(target=lambda: results.update(vr=visual_retrieval.run(vr_cfg)),
                                     name="demo-retrieval")
        retrieval.start()
        results["va"] = video_analytics.run(va_cfg)
        retrieval.join()
        stats = server.loop.call(lambda e: e.stats())
        adapters = server.loop.call(lambda e: e.list_adapters())
    finally:
        server.close()

    print("[demo 4/4] report", file=log, flush=True)
    engine = {"policy": getattr(stats, "policy", None), "mode_switches": getattr(stats, "mode_switches", 0),
              "switch_ms_total": round(getattr(stats, "switch_ms_total", 0.0), 3),
              "steps_by_mode": getattr(stats, "steps_by_mode", {}), "adapters": len(adapters),
              "adapter_names": [a["name"] for a in adapters], "steps": stats.num_steps,
              "generated_tokens": stats.generated_tokens}
    report = {"model": Path(model_path).name, "profile": profile, "offline": {k: offline_report[k] for k in ("adapters", "timings_s")},
              "domains": offline_report["domains"], "not_measured": offline_report.get("not_measured") or {},
              "streams": _stream_rows(results["va"]),
              "retrieval": _retrieval_rows(results.get("vr", {})), "retrieval_overall": results.get("vr", {}).get("overall"),
              "engine": engine, "seconds": {"offline": round(t_offline, 1),
                                            "total": round(time.perf_counter() - began, 1)}}
    out = Path(d.gpu.report_dir if profile == "gpu" else d.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    text = report_lines(report)
    (out / "report.md").write_text("\n".join(text) + "\n")
    _plot(report, out / "report.png")
    print("\n".join(text))
    print(f"\nreport: {out}/report.md, report.json, report.png")
    return report
