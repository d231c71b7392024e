"""The demo's plot: per stream and task, chunk latency against its latency target and the score
against its accuracy target (bars coloured by verdict, the verdict written on each); per
retrieval kind, accuracy and p50 latency. Every mark has a legend entry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .demo_report import MET, MISSED, NO_ADAPTER, NO_TARGET

COLORS = {MET: "tab:green", MISSED: "tab:red", NO_ADAPTER: "tab:orange"}  # other verdicts: grey
TARGET = {"marker": "_", "s": 500, "color": "black", "zorder": 3}  # a short line over the bar it judges
BELOW = {"fontsize": 7, "ncol": 2, "loc": "upper center", "bbox_to_anchor": (0.5, -0.2)}  # clear of every bar


def plot(report: dict[str, Any], path: str | Path) -> dict[str, list[str]]:
    """Writes the plot; returns each panel's legend labels (none when there is nothing to plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows, kinds = report["streams"], report.get("retrieval") or []
    if not rows and not kinds:
        return {}
    labels = [f"{r['stream']}\n{r['task']}" for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(max(11, 1.8 * (len(rows) + len(kinds))), 4.6))
    x = list(range(len(rows)))
    ax1.bar([i - 0.2 for i in x], [r["p50_ms"] or 0 for r in rows], 0.4, label="p50")
    ax1.bar([i + 0.2 for i in x], [r["p95_ms"] or 0 for r in rows], 0.4, label="p95")
    slo = [(i, r["latency_ms"]) for i, r in zip(x, rows) if r.get("latency_ms")]
    if slo:
        ax1.scatter(*zip(*slo), label="latency target", **TARGET)
    ax1.set_xticks(x, labels, fontsize=7)
    ax1.set_ylabel("chunk latency (ms)")
    ax1.set_ylim(bottom=0)
    ax1.legend(**BELOW)

    ax2.bar(x, [r["accuracy"] or 0 for r in rows], color=[COLORS.get(r["verdict"], "tab:gray") for r in rows])
    _targets_and_verdicts(ax2, rows)
    ax2.set_xticks(x, labels, fontsize=7)
    ax2.set_ylabel("score vs world truth\n(accuracy; F1 for detect)", fontsize=8)
    ax2.set_ylim(0, 1.12)
    shown = list(dict.fromkeys(r["verdict"] for r in rows if r["verdict"] in COLORS))
    handles = [Patch(color=COLORS[v], label=v) for v in shown]
    ax2.legend(handles=handles + ax2.get_legend_handles_labels()[0], **BELOW)

    # retrieval: accuracy per query kind (bars) and its p50 latency (dots, on a second axis)
    xk = list(range(len(kinds)))
    ax3.bar(xk, [k["accuracy"] or 0 for k in kinds], color="tab:green", label="accuracy")
    _targets_and_verdicts(ax3, kinds)
    ax3.set_xticks(xk, [k["kind"] for k in kinds], fontsize=7, rotation=20)
    ax3.set_ylabel("retrieval accuracy")
    ax3.set_ylim(0, 1.12)
    ax3.set_title("visual retrieval", fontsize=8)
    lat = ax3.twinx()
    lat.plot(xk, [k["p50_ms"] or 0 for k in kinds], "o", color="black", label="p50 latency (ms)")
    lat.set_ylabel("p50 latency (ms)", fontsize=7)
    lat.set_ylim(0, 1.15 * max([k["p50_ms"] or 0 for k in kinds] + [1]))  # the highest dot clear of the frame
    bars, dots = ax3.get_legend_handles_labels(), lat.get_legend_handles_labels()
    ax3.legend(bars[0] + dots[0], bars[1] + dots[1], **BELOW)

    adapters = report["engine"].get("adapters", 0)
    fig.suptitle(f"V-LoRA demo: {report['model']}, {adapters} adapter{'s' if adapters != 1 else ''} served", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {name: [t.get_text() for t in ax.get_legend().get_texts()]
            for name, ax in (("latency", ax1), ("score", ax2), ("retrieval", ax3))}


def _targets_and_verdicts(ax, rows: list[dict[str, Any]]) -> None:
    """The accuracy target of each bar (where it has one) and its verdict written above it (the
    score where there is no target); a bar with no measured score says n/a (see the report's
    footnotes), not zero."""
    judged = [(i, r["target"]) for i, r in enumerate(rows) if r.get("target")]
    if judged:
        ax.scatter(*zip(*judged), label="accuracy target", **TARGET)
    for i, r in enumerate(rows):
        top = max(r["accuracy"] or 0, r.get("target") or 0)
        text = ("n/a" if r["accuracy"] is None else f"{r['accuracy']:.2f}" if r["verdict"] == NO_TARGET
                else r["verdict"])
        ax.text(i, top + 0.03, text, ha="center", fontsize=6)
