"""Tables and plots of policy sweeps (matplotlib only here, imported on use)."""

from __future__ import annotations

from pathlib import Path

from serve.orchestrator.profile import CostProfile

from .evaluate import aggregate

XLABELS = {"rate": "request rate (requests/s)", "skewness": "skewness (share of the most requested adapter)",
           "adapters": "number of adapters"}


def profile_label(profile: CostProfile) -> str:
    tag = "ASSUMED profile, not measured" if profile.assumed else f"measured on {profile.device}"
    return f"{profile.name} ({tag})"


def table(rows: list[dict], profile: CostProfile, metric: str = "avg_token_latency_ms") -> str:
    """Markdown: one table per sweep, x down, policies across, the best of each line in bold."""
    out = [f"Average token latency (ms per output token), {profile_label(profile)}", ""]
    for sweep, by_x in aggregate(rows, metric).items():
        policies = sorted({p for v in by_x.values() for p in v})
        out += [f"**{XLABELS[sweep]}**", "", "| " + " | ".join([sweep, *policies]) + " |",
                "|" + " --- |" * (len(policies) + 1)]
        for x, by_p in by_x.items():
            best = f"{min(by_p.values()):.1f}"
            cells = [("" if p not in by_p else f"**{by_p[p]:.1f}**" if f"{by_p[p]:.1f}" == best else
                      f"{by_p[p]:.1f}") for p in policies]
            out.append("| " + " | ".join([f"{x:g}", *cells]) + " |")
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], profile: CostProfile, out_dir: str | Path,
         metric: str = "avg_token_latency_ms") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for sweep, by_x in aggregate(rows, metric).items():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        policies = sorted({p for v in by_x.values() for p in v})
        for i, p in enumerate(policies):  # distinct markers and dashes: equal policies stay visible
            xs = [x for x in by_x if p in by_x[x]]
            ax.plot(xs, [by_x[x][p] for x in xs], marker="osv^Dx"[i % 6], linestyle=("-", "--", ":")[i % 3],
                    markersize=5 + (i % 3), label=p)
        if sweep == "adapters":
            ax.set_xscale("log", base=2)
        ax.set_xlabel(XLABELS[sweep])
        ax.set_ylabel("average token latency (ms)")
        ax.set_yscale("log")
        ax.set_title(f"latency vs {sweep}\n{profile_label(profile)}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(out_dir) / f"latency_vs_{sweep}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def metrics_table(results: dict[str, dict]) -> str:
    """Markdown: one line per policy with the main metrics (`results`: policy -> Metrics.as_row())."""
    cols = [("avg_token_latency_ms", "ms/token", ".1f"), ("p50_ms", "p50 ms", ".0f"), ("p95_ms", "p95 ms", ".0f"),
            ("p99_ms", "p99 ms", ".0f"), ("throughput_rps", "req/s", ".2f"), ("slo_attainment", "in target", ".2f"),
            ("switches", "switches", "d"), ("switch_ms", "switch ms", ".0f")]
    out = ["| policy | " + " | ".join(c[1] for c in cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    for name, m in results.items():
        out.append(f"| {name} | " + " | ".join(format(m[k], f) for k, _, f in cols) + " |")
    return "\n".join(out)
