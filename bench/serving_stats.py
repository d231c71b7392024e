"""What the serving evaluation concludes from its rows: the capacity of a burst, means with 95%
intervals over seeds, each point against the best fixed policy, and plots with error bars.

    capacity_rps(finish_ms)                 # served requests/s of a burst, its middle 80%
    summary = summarize_points(rows)        # one row per (sweep, skewness, x, policy) over the seeds
    verdicts(summary)                       # V-LoRA against the best fixed policy at each point

A point's interval is the t-interval of the mean over its seeds (different traces of the same
workload): mean +- t(0.975, n - 1) * sd / sqrt(n); one seed has none (nan).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

# Student's t, two-sided 95%, by degrees of freedom (1..30); past 30 the normal's 1.96 is close enough
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
FIXED = ("unmerge_only", "merge_only", "dlora")  # the fixed policies V-LoRA's is held against


def mean_interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% t-interval); the half-width is nan below two values."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    if n < 2:
        return mean, math.nan
    t = _T95[n - 2] if n - 1 <= len(_T95) else 1.96
    return mean, t * statistics.stdev(values) / math.sqrt(n)


def capacity_rps(finish_ms: list[float]) -> float:
    """Requests per second a burst was served at: the finishes between its 10th and 90th percentile
    over the time between them (the ramp-up and the last, ever smaller batches left out)."""
    done = sorted(finish_ms)
    if len(done) < 10:
        raise ValueError(f"a capacity burst needs at least 10 finished requests, got {len(done)}")
    lo, hi = int(0.1 * len(done)), int(0.9 * len(done))
    span_s = (done[hi] - done[lo]) / 1e3
    return (hi - lo) / span_s if span_s > 0 else math.inf


def summarize_points(rows: list[dict], metric: str = "avg_token_latency_ms") -> list[dict]:
    """One row per (sweep, skewness, x, policy): mean, 95% half-width, min and max of `metric` over
    the seeds, how many seeds, and the mean offered rate."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["sweep"], float(r["skewness"]), float(r["x"]), r["policy"])
        groups.setdefault(key, []).append(r)
    out = []
    for (sweep, skew, x, policy), rs in sorted(groups.items(), key=lambda kv: kv[0]):
        values = [float(r[metric]) for r in rs]
        mean, half = mean_interval(values)
        out.append(dict(sweep=sweep, skewness=skew, x=x, policy=policy, seeds=len(values), mean=mean, ci95=half,
                        min=min(values), max=max(values), rate=statistics.fmean(float(r["rate"]) for r in rs),
                        completed=sum(int(r["completed"]) for r in rs), requests=sum(int(r["requests"]) for r in rs)))
    return out


def verdicts(summary: list[dict], policy: str = "v_lora", fixed: tuple[str, ...] = FIXED) -> list[dict]:
    """At each point: `policy`'s mean against the best fixed policy's and against unmerge-only's
    (ratio < 1: lower latency), with whether the intervals overlap."""
    points: dict[tuple, dict[str, dict]] = {}
    for s in summary:
        points.setdefault((s["sweep"], s["skewness"], s["x"]), {})[s["policy"]] = s
    out = []
    for (sweep, skew, x), by_p in points.items():
        if policy not in by_p:
            continue
        present = [p for p in fixed if p in by_p]
        if not present:
            continue
        best = min(present, key=lambda p: by_p[p]["mean"])
        me, b = by_p[policy], by_p[best]
        unmerge = by_p.get("unmerge_only")
        out.append(dict(sweep=sweep, skewness=skew, x=x, best_fixed=best, ratio_best=me["mean"] / b["mean"],
                        within_5pct=me["mean"] <= 1.05 * b["mean"], overlap=_overlap(me, b),
                        ratio_unmerge=me["mean"] / unmerge["mean"] if unmerge else math.nan))
    return out


def _overlap(a: dict, b: dict) -> bool:
    if math.isnan(a["ci95"]) or math.isnan(b["ci95"]):
        return True
    return a["mean"] - a["ci95"] <= b["mean"] + b["ci95"] and b["mean"] - b["ci95"] <= a["mean"] + a["ci95"]


def summary_table(summary: list[dict]) -> str:
    """Markdown: per sweep and skewness, x down, policies across, mean +- half-width (ms/token)."""
    out = []
    blocks: dict[tuple, dict[float, dict[str, dict]]] = {}
    for s in summary:
        blocks.setdefault((s["sweep"], s["skewness"]), {}).setdefault(s["x"], {})[s["policy"]] = s
    for (sweep, skew), by_x in blocks.items():
        policies = sorted({p for v in by_x.values() for p in v})
        out += [f"**{sweep}, skewness {skew:g}** (mean ms/token +- 95% interval over seeds)", "",
                "| " + " | ".join([sweep, "req/s", *policies]) + " |", "|" + " --- |" * (len(policies) + 2)]
        for x, by_p in sorted(by_x.items()):
            best = min(v["mean"] for v in by_p.values())
            rate = next(iter(by_p.values()))["rate"]
            cells = []
            for p in policies:
                if p not in by_p:
                    cells.append("")
                    continue
                v = by_p[p]
                text = f"{v['mean']:.1f}" + ("" if math.isnan(v["ci95"]) else f" +- {v['ci95']:.1f}")
                cells.append(f"**{text}**" if v["mean"] == best else text)
            out.append("| " + " | ".join([f"{x:g}", f"{rate:.1f}", *cells]) + " |")
        out.append("")
    return "\n".join(out)


def plot_points(summary: list[dict], out_dir: str | Path, title: str) -> list[Path]:
    """One figure per sweep: a panel per skewness, mean token latency with 95% error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for sweep in dict.fromkeys(s["sweep"] for s in summary):
        rows = [s for s in summary if s["sweep"] == sweep]
        skews = sorted({s["skewness"] for s in rows})
        fig, axes = plt.subplots(1, len(skews), figsize=(4.2 * len(skews), 3.8), squeeze=False)
        policies = sorted({s["policy"] for s in rows})
        for ax, skew in zip(axes[0], skews):
            for i, p in enumerate(policies):
                pts = sorted((s["x"], s["mean"], s["ci95"]) for s in rows if s["skewness"] == skew and s["policy"] == p)
                if not pts:
                    continue
                xs, ys, es = zip(*pts)
                ax.errorbar(xs, ys, yerr=[0 if math.isnan(e) else e for e in es], marker="osv^Dx"[i % 6],
                            linestyle=("-", "--", ":")[i % 3], capsize=3, label=p)
            ax.set_title(f"skewness {skew:g}", fontsize=9)
            ax.set_xlabel("load (share of unmerge-only capacity)" if sweep == "load" else sweep)
            ax.set_ylabel("average token latency (ms)")
            ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        path = Path(out_dir) / f"latency_vs_{sweep}_ci.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def learning_note(row: dict) -> str:
    err = row.get("pred_err_median")
    if err is None or err == "" or (isinstance(err, float) and math.isnan(err)):
        return ""
    slowest = row.get("slowest_step_ms")
    slow = (f", slowest step {float(slowest):.0f} ms ({row.get('slowest_step_mode')}, predicted "
            f"{float(row.get('slowest_step_pred_ms')):.0f})") if slowest not in (None, "") else ""
    return (f", step cost predicted within {100 * float(err):.1f}% (median), "
            f"guard fell back {row.get('guard_fallback_steps', 0)} steps (to merge {row.get('guard_to_merge', 0)}x, "
            f"to unmerge {row.get('guard_to_unmerge', 0)}x){slow}, {row.get('kernel_compiles', 0)} kernels compiled")


def learning_summary(rows: list[dict]) -> list[dict]:
    """Per learning policy over its replays: the median of each replay's median step-cost error
    (predicted before the step was learnt from; the target is <= 0.15), the share of replays
    within 15%, and the guard's engagements and fallback steps in all."""
    by_policy: dict[str, list[dict]] = {}
    for r in rows:
        err = r.get("pred_err_median")
        if err not in (None, "") and not math.isnan(float(err)):
            by_policy.setdefault(r["policy"], []).append(r)
    out = []
    for policy, rs in by_policy.items():
        errs = [float(r["pred_err_median"]) for r in rs]
        out.append(dict(policy=policy, replays=len(rs), pred_err_median=statistics.median(errs),
                        within_15pct=sum(e <= 0.15 for e in errs) / len(errs),
                        guard_engaged=sum(int(r.get("guard_engaged") or 0) for r in rs),
                        guard_fallback_steps=sum(int(r.get("guard_fallback_steps") or 0) for r in rs)))
    return out
