"""The offline stage's default, run fresh with several seeds, and the table of the runs.

    vlora bench bench.suite=offline bench.offline.root=/tmp/seeds "bench.offline.seeds=[0,1,2]"
    python -m bench.offline_seeds --root /tmp/seeds --seeds 0 1 2 --out results/offline/seeds
    python -m bench.offline_seeds --root /tmp/seeds --seeds 0 1 2 --out results/offline/seeds -- offline.per_domain=false

Each seed runs `vlora offline seed=<s>` in a home of its own (`<root>/seed<s>`: its own world,
teachers, datasets and pretraining), so the runs share nothing. A seed whose report already
exists is not run again (delete its home to redo it). Extra arguments after `--` go to every run.
The table: per seed, the adapters and domains per adapter, every domain's fused accuracy against
its requirement, and whether all were met; then, where the reports trained them, fusion against
one adapter for all and one adapter per domain: each method's mean score over the domains per
seed, and the fused-minus-other difference's mean with its 95% t interval over the seeds (so a
difference is called only when the runs resolve it). `seeds.json` holds every report whole;
`--from-json` rebuilds the table from one without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fusion.confidence import mean_interval, requirement_within


def run_seed(root: Path, seed: int, extra: list[str]) -> dict:
    home = root / f"seed{seed}"
    report = home / "results" / "offline" / "report.json"
    if not report.is_file():
        env = {**os.environ, "VLORA_HOME": str(home)}
        start = time.perf_counter()
        with open(root / f"seed{seed}.log", "w") as log:
            done = subprocess.run([sys.executable, "-m", "vlora", "offline", f"seed={seed}", *extra], env=env,
                                  stdout=log, stderr=subprocess.STDOUT)
        if done.returncode:
            raise SystemExit(f"offline stage for seed {seed} failed (exit {done.returncode}); see {root}/seed{seed}.log")
        print(f"[seeds] seed {seed}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return json.loads(report.read_text())


OTHERS = ("one_adapter_for_all", "one_adapter_per_domain")  # what the report trains beside fusion


def seed_rows(reports: dict[int, dict]) -> list[dict]:
    rows = []
    for seed, rep in reports.items():
        doms = rep["domains"]
        row = {"seed": seed, "adapters": rep["adapters"]["fused"],
               "domains_per_adapter": round(len(doms) / rep["adapters"]["fused"], 2) if rep["adapters"]["fused"] else 0.0,
               "all_met": all(d["meets_requirement"] for d in doms)}
        row.update({d["domain"]: ("rejected" if d["fused"] is None else f"{d['fused']:.3f}")  # fusion refused it
                    + f"/{d['requirement']}"
                    + ("*" if requirement_within(d.get("fused_95"), d["requirement"]) else "") for d in doms})
        for key in OTHERS:
            if all(d.get(key) is not None for d in doms):
                row[f"{key}_met"] = sum(d[key] >= d["requirement"] for d in doms)
        for key in ("fused", *OTHERS):
            if all(d.get(key) is not None for d in doms):
                row[f"{key}_mean"] = round(sum(d[key] for d in doms) / len(doms), 3)
        row["total_s"] = (rep.get("timings_s") or {}).get("total_s")
        rows.append(row)
    return rows


def against_others(rows: list[dict]) -> list[str]:
    """Per other method: fused minus its mean score, by seed, and the mean difference's 95% t
    interval over the seeds (at least two seeds that trained it)."""
    lines = []
    for key in OTHERS:
        diffs = [r["fused_mean"] - r[f"{key}_mean"] for r in rows if f"{key}_mean" in r and "fused_mean" in r]
        if len(diffs) < 2:
            continue
        mean, lo, hi = mean_interval(diffs)
        verdict = ("fusion ahead" if lo > 0 else "fusion behind" if hi < 0
                   else "the runs do not resolve a difference")
        lines.append(f"Fused minus {key.replace('_', ' ')}, mean score over the domains: "
                     f"{', '.join(f'{d:+.3f}' for d in diffs)} by seed; mean {mean:+.3f}, 95% interval "
                     f"{lo:+.3f} to {hi:+.3f} over {len(diffs)} runs: {verdict}.")
    return lines


def main(argv: list[str] | None = None, command: str | None = None) -> list[dict]:
    """Runs (or tabulates) the seeds; returns the table's rows. `command`: how the caller was
    invoked (`vlora bench bench.suite=offline ...`), recorded in seeds.md instead of this module's."""
    from .streams_report import format_table

    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m bench.offline_seeds", description=__doc__.split("\n")[0])
    p.add_argument("--root", help="one home per seed goes under it (required unless --from-json)")
    p.add_argument("--from-json", help="a seeds.json this command wrote: tabulate its reports, run nothing")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", required=True, help="folder for seeds.md and seeds.json")
    args = p.parse_args(own)
    out, this = Path(args.out), command or f"python -m bench.offline_seeds {' '.join(argv)}"
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        extra, reports = saved["extra_args"], {int(s): r for s, r in saved["reports"].items()}
        ran = saved.get("command", "not recorded")
    elif args.root:
        root = Path(args.root)
        root.mkdir(parents=True, exist_ok=True)
        reports = {s: run_seed(root, s, extra) for s in args.seeds}
        ran = this
    else:
        p.error("give --root (run the seeds) or --from-json (tabulate saved runs)")
    rows = seed_rows(reports)
    out.mkdir(parents=True, exist_ok=True)
    (out / "seeds.json").write_text(json.dumps({"command": ran, "extra_args": extra, "reports": reports}, indent=1))
    columns = tuple(dict.fromkeys(k for r in rows for k in r))  # every seed's columns, first seen first
    table = format_table(rows, columns)
    met = sum(r["all_met"] for r in rows)
    lines = ["# Offline stage, fresh runs by seed", "", f"command: `{ran}`",
             *([f"tabulated from its saved reports by: `{this}`"] if this != ran else []), "",
             "```", table, "```", "", f"Every requirement met in {met} of {len(rows)} runs; domains per adapter "
             f"{', '.join(str(r['domains_per_adapter']) for r in rows)}. Cells: fused accuracy / requirement; * the "
             "requirement lies inside the score's 95% interval over its eval items (reports that record one), so "
             "another draw of eval items could turn that verdict.",
             *(x for line in against_others(rows) for x in ("", line))]
    (out / "seeds.md").write_text("\n".join(lines) + "\n")
    print(table)
    return rows


if __name__ == "__main__":
    main()
