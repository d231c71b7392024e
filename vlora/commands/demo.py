"""`vlora demo`: the main job on the built-in default, end to end.

1. the offline stage (`vlora offline`): the tiny zoo model and its world pretraining, the
   teachers, one distilled dataset per knowledge domain, knowledge fusion into adapters with
   task heads (every step cached: a second run reuses them);
2. the server (`vlora serve`) on that model with the fused adapters, the orchestrator's policy
   and the RPyC service, in this process;
3. several synthetic camera feeds (`vlora video_analytics`) and a batch of retrieval queries
   (`vlora visual_retrieval`) through the client library, at the same time as each other's load;
4. a report per stream and task and per retrieval kind (the route that served it, its target,
   its score against the world's truth, MET / MISSED / NO ADAPTER and why, unparsed answers,
   latency percentiles, drops), and of the engine (mode switches, adapters), as JSON, Markdown
   and a plot; the run ends with one line per missed target.

Quiet by default: what the stages write (ultralytics' training, progress bars, the apps' lines)
goes to demo.log next to the report, the console gets one line per stage (demo.verbose=true:
everything, as well).

Each stage is composed from its own primary config (conf/offline.yaml, serve.yaml,
video_analytics.yaml, visual_retrieval.yaml) with the overrides listed under `demo:`, so the
same run on a GPU with a real checkpoint is a matter of config values.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ..config import compose
from .capture import CapturedOutput
from .demo_plot import plot
from .demo_report import missed_lines, report_lines, retrieval_rows, stream_rows, task_targets, verdict_lines

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


def run(cfg: DictConfig) -> dict:
    d = cfg.demo
    profile = resolve_profile(str(d.profile))
    out = Path(d.gpu.report_dir if profile == "gpu" else d.report_dir)
    began = time.perf_counter()
    # the stages' own output (ultralytics' training, progress bars, the apps' lines) goes to the
    # log; the console gets a line per stage, then the report (demo.verbose=true: everything)
    with CapturedOutput(out / "demo.log", verbose=bool(d.verbose)) as console:
        console.say(f"[demo] output of every stage: {out / 'demo.log'}")
        parts = _run_stages(cfg, profile, console.say)
    report = _report(parts, profile, began)
    write_report(report, out)
    return report


def write_report(report: dict, out: Path) -> None:
    """report.json, report.md and report.png in `out`, and the report on the console, ending with
    one line per missed target (or one saying every target was met)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    text = report_lines(report)
    (out / "report.md").write_text("\n".join(text) + "\n")
    plot(report, out / "report.png")
    verdicts = verdict_lines(report)
    print("\n".join(text[:-len(verdicts)]))
    print(f"report: {out}/report.md, report.json, report.png; output of every stage: {out / 'demo.log'}")
    print("\n".join(verdicts), flush=True)


def _run_stages(cfg: DictConfig, profile: str, say) -> dict:
    """The offline stage, the server, the streams and queries: what the report is made of."""
    from . import offline, video_analytics, visual_retrieval, world
    from .serve import start_server

    d = cfg.demo
    seed, token = int(cfg.seed), str(d.token)
    over = {stage: stage_overrides(d, profile, stage)
            for stage in ("offline", "world", "serve", "video_analytics", "visual_retrieval")}
    began = time.perf_counter()
    say(f"[demo 1/4] offline stage ({profile} profile): teachers, datasets, fusion "
        "(minutes the first time; a later run reuses them)")
    offline_report = offline.run(_stage("offline", over["offline"], seed))
    model_path = offline_report["model_path"]
    world.run(_stage("world", over["world"], seed))  # the retrieval collection (kept when already written)
    t_offline = time.perf_counter() - began

    say(f"[demo 2/4] server on {model_path} with {offline_report['adapters']['fused']} fused adapter(s)")
    serve_cfg = _stage("serve", over["serve"], seed, [f"model.path={model_path}", f"rpc.token={token}"])
    server = start_server(serve_cfg, token, 16)
    connect = [f"server.port={server.port}", f"server.token={token}"]
    try:
        va_cfg = _stage("video_analytics", over["video_analytics"], seed, connect)
        vr_cfg = _stage("visual_retrieval", over["visual_retrieval"], seed, connect)
        say(f"[demo 3/4] {len(va_cfg.streams)} camera streams for {va_cfg.duration_s} s and retrieval queries "
            "through the client")
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
    say("[demo 4/4] report")
    return {"offline": offline_report, "t_offline": t_offline, "stats": stats, "adapters": adapters,
            "targets": task_targets(OmegaConf.to_container(va_cfg.streams, resolve=True)),
            "retrieval_target": float(vr_cfg.accuracy_target), **results}


def _report(parts: dict, profile: str, began: float) -> dict:
    stats, adapters, offline_report = parts["stats"], parts["adapters"], parts["offline"]
    engine = {"policy": getattr(stats, "policy", None), "mode_switches": getattr(stats, "mode_switches", 0),
              "switch_ms_total": round(getattr(stats, "switch_ms_total", 0.0), 3),
              "steps_by_mode": getattr(stats, "steps_by_mode", {}), "adapters": len(adapters),
              "adapter_names": [a["name"] for a in adapters], "steps": stats.num_steps,
              "generated_tokens": stats.generated_tokens}
    vr = parts.get("vr", {})
    report = {"model": Path(offline_report["model_path"]).name, "profile": profile,
              "offline": {k: offline_report[k] for k in ("adapters", "timings_s")},
              "domains": offline_report["domains"], "not_measured": offline_report.get("not_measured") or {},
              "streams": stream_rows(parts["va"], parts["targets"]),
              "retrieval": retrieval_rows(vr, parts["retrieval_target"]), "retrieval_overall": vr.get("overall"),
              "engine": engine, "seconds": {"offline": round(parts["t_offline"], 1),
                                            "total": round(time.perf_counter() - began, 1)}}
    report["missed"] = missed_lines(report)
    return report
