"""The batch report: per query kind and overall, how many were answered, their scores and
latency percentiles."""

from __future__ import annotations

from typing import Any

from apps.common.stats import percentiles


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if "error" not in r]
    scored = [r for r in done if "correct" in r.get("scores", {})]
    out = {"queries": len(rows), "errors": len(rows) - len(done),
           "input_errors": sum(bool(r.get("input_error")) for r in rows), "scored": len(scored),
           "accuracy": _mean([float(r["scores"]["correct"]) for r in scored]),
           "latency_ms": percentiles(r["latency_ms"] for r in done)}
    for key in ("exact", "vqa", "iou", "token_f1"):
        values = [r["scores"][key] for r in done if key in r.get("scores", {})]
        if values:
            out[key] = _mean(values)
    return out


def summarise(results: list[dict[str, Any]], skipped: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """accuracy is the share of scored queries answered correctly: VQA score 1 for answers,
    IoU >= 0.5 for boxes. input_errors: queries whose image is missing, truncated or corrupt (not
    sent). skipped: the query file's malformed lines, {"line", "error"} each."""
    kinds = sorted({r["kind"] for r in results})
    by_kind = {k: _summary([r for r in results if r["kind"] == k]) for k in kinds}
    overall = dict(_summary(results), skipped_lines=len(skipped or []))
    return {"overall": overall, "by_kind": by_kind, "skipped": list(skipped or [])}
