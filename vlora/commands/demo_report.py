"""The demo's report from the apps' own reports: every online task (a stream's task, a retrieval
query kind) with the route that served it, its target, its score, a verdict and the reason in one
line; the offline stage's domains above them; one line per missed target at the end.

Verdicts of a scored task with target t:
    MET         score >= t
    MISSED      score < t on the adapter routing chose
    NO ADAPTER  score < t on the base model: routing found no adapter (the reason says why)
    NO TARGET   t is 0: the score is shown, not judged
    NOT SCORED  no ground truth on the source (or nothing answered)

Beside each route's expected accuracy (what the adapter scored in training) is the majority baseline
its training recorded (always answering the most common training label, on the same eval items),
and a route whose adapter is no better than it says so: "always '2' 0.438 NO BETTER".
"""

from __future__ import annotations

from typing import Any

from .offline_report import MISSED, domain_lines, explained_table

MET, NO_ADAPTER, NO_TARGET, NOT_SCORED = "MET", "NO ADAPTER", "NO TARGET", "NOT SCORED"
MISSES = (MISSED, NO_ADAPTER)

# why a cell of the stream and retrieval tables holds no number
STREAM_REASONS = {"accuracy": "no ground truth on this source (only the synthetic world carries it)",
                  "agreement": "no shadow teacher on this stream and task, or it compared no chunk yet",
                  "compared": "no shadow teacher on this stream and task",
                  "p50_ms": "no chunk answered", "p95_ms": "no chunk answered", "p99_ms": "no chunk answered",
                  "expected": "no adapter was selected (the base model answers)",
                  "baseline": "no adapter was selected (the base model answers)"}
RETRIEVAL_REASONS = {"accuracy": "no query of this kind had a known answer",
                     "p50_ms": "no query of this kind was answered", "p95_ms": "no query of this kind was answered",
                     "expected": "no adapter was selected (the base model answers)",
                     "baseline": "no adapter was selected (the base model answers)"}
LINE_ONLY = ("reason", "metric", "requests", "slo_violations", "latency_ms")  # in the task's line, not the table


def task_targets(streams: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(stream, task) -> its accuracy target, latency target and metric, from the streams' settings
    (conf/video_analytics.yaml's `streams`): the apps' reports do not repeat them."""
    from apps.video_analytics import stream_from_dict

    out = {}
    for s in streams:
        config = stream_from_dict(s)
        for t in config.tasks:
            out[(config.name, t.label)] = {"target": float(t.accuracy_target), "latency_ms": t.latency_ms,
                                           "metric": "F1" if t.task == "detect" else "accuracy"}
    return out


def expected_cell(route: dict[str, Any]) -> float | None:
    """The accuracy the selected adapter reached in training; None when routing selected none."""
    value = route.get("expected_accuracy") if route.get("selected") else None
    return None if value is None else round(float(value), 3)


def baseline_cell(route: dict[str, Any]) -> str | None:
    """The selected adapter's majority baseline beside its expected accuracy: "always '2' 0.438",
    flagged "NO BETTER" when the adapter is no better than it; "not recorded" when its meta.json has
    none; None when routing selected no adapter."""
    if not route.get("selected"):
        return None
    majority = (route.get("baselines") or {}).get("majority")
    if not majority:
        return "not recorded"
    answer = majority.get("answer")
    shown = "" if answer is None else f"always {answer!r} " if isinstance(answer, str) else f"always {answer} "
    return f"{shown}{float(majority['accuracy']):.3f}" + (" NO BETTER" if route.get("no_better") else "")


def verdict(score: float | None, target: float, adapter: str | None) -> str:
    if score is None:
        return NOT_SCORED
    if target <= 0:
        return NO_TARGET
    if score >= target:
        return MET
    return MISSED if adapter else NO_ADAPTER


def stream_rows(va: dict[str, Any], targets: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """A row per stream and task; agreement with a shadow teacher (and chunks compared) where any is set."""
    rows = []
    shadowed = any("shadow" in t for s in va["streams"].values() for t in s["tasks"].values())
    for name, s in va["streams"].items():
        for task, t in s["tasks"].items():
            route, lat = s["routes"][task], t["latency_ms"]
            goal = targets.get((name, task)) or {"target": 0.0, "latency_ms": None, "metric": "accuracy"}
            score = None if t["accuracy"] is None else round(t["accuracy"], 3)
            rows.append({"stream": name, "task": task, "route": f"{route['adapter'] or 'base'}/{route['output_mode']}",
                         "target": goal["target"], "accuracy": score,
                         "verdict": verdict(score, goal["target"], route["adapter"]),
                         "expected": expected_cell(route), "baseline": baseline_cell(route),
                         "answers": t["requests"], "unparsed": t["unparsed"],
                         "chunks": s["chunks_processed"], "dropped": s["chunks_dropped"],
                         "p50_ms": lat["p50"], "p95_ms": lat["p95"], "p99_ms": lat["p99"],
                         "metric": goal["metric"], "latency_ms": goal["latency_ms"], "requests": t["requests"],
                         "errors": t["errors"], "slo_violations": t["slo_violations"], "reason": route["reason"]})
            if shadowed:
                rows[-1].update(agreement=(t.get("shadow") or {}).get("agreement"),
                                compared=(t.get("shadow") or {}).get("compared"))
    return rows


def retrieval_rows(vr: dict[str, Any], target: float = 0.0) -> list[dict[str, Any]]:
    """A row per query kind with the route(s) its queries took (a kind routed per question may
    take several), as `vlora visual_retrieval` prints them."""
    from apps.common.routing import route_cell
    from apps.visual_retrieval import route_kind

    rows = []
    for kind, k in (vr.get("by_kind") or {}).items():
        routes = [r for name, r in (vr.get("routes") or {}).items() if route_kind(name) == kind]
        adapter = next((r["adapter"] for r in routes if r["adapter"]), None)
        lat = k.get("latency_ms") or {}
        score = k["accuracy"]
        expected = [expected_cell(r) for r in routes if expected_cell(r) is not None]
        baselines = sorted({baseline_cell(r) for r in routes if baseline_cell(r) is not None})
        rows.append({"kind": kind, "route": ",".join(sorted({route_cell(r) for r in routes})) or "-",
                     "target": target, "accuracy": score, "verdict": verdict(score, target, adapter),
                     "expected": ",".join(f"{e:.3f}" for e in sorted(set(expected))) or None,
                     "baseline": ",".join(baselines) or None,
                     "queries": k["queries"], "errors": k["errors"], "p50_ms": lat.get("p50"), "p95_ms": lat.get("p95"),
                     "metric": "accuracy", "reason": "; ".join(dict.fromkeys(r["reason"] for r in routes if r["reason"]))})
    return rows


def task_line(row: dict[str, Any]) -> str:
    """One task in one line: verdict, score against target, route, why that route, unparsed answers."""
    name = f"{row['stream']} {row['task']}" if "stream" in row else f"retrieval {row['kind']}"
    score, target = row["accuracy"], row["target"]
    if score is None:
        scored = f"{row['metric']} not measured"
    elif row["verdict"] == NO_TARGET:
        scored = f"{row['metric']} {score:.3f} (no target)"
    else:
        scored = f"{row['metric']} {score:.3f} {'>=' if score >= target else '<'} target {target}"
    parts = [f"{name}: {row['verdict']}, {scored} on {row['route']}", row.get("reason") or "no route recorded"]
    if row.get("unparsed"):
        parts.append(f"{row['unparsed']} of {row['answers']} answers unparsed (nothing to read in the text: scored as no answer)")
    if row.get("errors"):
        parts.append(f"{row['errors']} requests failed")
    if row.get("slo_violations"):
        parts.append(f"{row['slo_violations']} answers over the {row['latency_ms']} ms latency target")
    return "; ".join(parts)


def missed_lines(report: dict[str, Any]) -> list[str]:
    """One line per missed target: each domain's requirement offline, each task's target online."""
    lines = [f"Missed requirement: {r['domain']} fused {r['fused']} < {r['requirement']} (adapter {r['fused_adapter']})"
             if not r.get("rejected") else f"Missed requirement: {r['domain']} rejected by fusion, {r['rejected']}"
             for r in report.get("domains") or [] if r.get("meets_requirement") is False]
    for row in (report.get("streams") or []) + (report.get("retrieval") or []):
        if row["verdict"] in MISSES:
            lines.append(f"Missed target: {task_line(row)}")
    return lines


def _table(rows: list[dict[str, Any]], reasons: dict[str, str]) -> tuple[str, list[str]]:
    return explained_table([{k: v for k, v in r.items() if k not in LINE_ONLY} for r in rows], reasons)


def report_lines(report: dict[str, Any]) -> list[str]:
    """The demo's Markdown report: the fused domains (every missed requirement flagged), the
    streams and the retrieval kinds (a line per task with its verdict and why), the engine."""
    text = [f"# V-LoRA demo ({report['model']})", ""]
    if report.get("domains"):
        text += ["Offline stage (fused adapters per domain):", *domain_lines(report), ""]
    if report["streams"]:
        table, notes = _table(report["streams"], STREAM_REASONS)
        text += ["Video analytics (accuracy against the world's truth; F1 of boxes for detect):", "```", table, "```",
                 *notes, "", *[f"- {task_line(r)}" for r in report["streams"]], ""]
    if report.get("retrieval"):
        table, notes = _table(report["retrieval"], RETRIEVAL_REASONS)
        text += ["Visual retrieval:", "```", table, "```", *notes]
        if not any(r["target"] for r in report["retrieval"]):
            text.append("No retrieval kind has an accuracy target (visual_retrieval.accuracy_target=0.0 only sets what "
                        "an adapter must reach to be routed): their scores are shown, not judged.")
        text += ["", *[f"- {task_line(r)}" for r in report["retrieval"]]]
    engine = report["engine"]
    text += ["", f"Engine: policy {engine['policy']}, {engine['adapters']} adapters, {engine['mode_switches']} mode "
                 f"switches ({engine['switch_ms_total']} ms), steps by mode {engine['steps_by_mode']}",
             f"Time: offline stage {report['seconds']['offline']} s, whole run {report['seconds']['total']} s"]
    return text + ["", *verdict_lines(report)]


def verdict_lines(report: dict[str, Any]) -> list[str]:
    """The report's last lines: one per missed target, or one saying every target was met."""
    return missed_lines(report) or [f"Every target met ({_counted(report)})."]


def _counted(report: dict[str, Any]) -> str:
    judged = [r for r in (report.get("streams") or []) + (report.get("retrieval") or [])
              if r["verdict"] not in (NO_TARGET, NOT_SCORED)]
    return f"{len(report.get('domains') or [])} domain requirements, {len(judged)} online targets"
