"""Prints the tables of one of this folder's sets of runs (counts, process_cpu, forgive): per run, each flood's
ratio (95% interval) and the victim's p95 alone; then per flood the victim's pacing at the gate (sleeps, ms), its
slowest probe and its probes over 90 ms, and the attacker's calls, ms paced and requests finished (or polls).

    python table.py SET
"""
import glob
import gzip
import json
import sys
from pathlib import Path

here = Path(__file__).parent / sys.argv[1]
runs = {Path(p).parts[-3]: json.load(open(p))["phases"]["floods"]["by_flood"]
        for p in sorted(glob.glob(str(here / "*" / "cpu" / "soak.json")))}
floods = list(next(iter(runs.values())))
print("| run | p95 alone, ms | " + " | ".join(floods) + " | all within 2x |")
print("| --- " * (3 + len(floods)) + "|")
for run, by in runs.items():
    alone = sorted(f["quiet"]["p95_ms"] for f in by.values())
    cells = [f"{by[n]['ratio']} ({by[n]['ratio_interval'][0]}-{by[n]['ratio_interval'][1]})" for n in floods]
    print(f"| {run} | {alone[0]:.1f}-{alone[-1]:.1f} | " + " | ".join(cells) + f" | {'yes' if all(f['ok'] for f in by.values()) else 'no'} |")
print()
print("| run | flood | victim: pacing sleeps, ms paced | its slowest probe, ms | probes over 90 ms | "
      "attacker: calls, ms paced | flood finished (polls) |")
print("| --- " * 7 + "|")
for run, by in runs.items():
    with gzip.open(here / run / "cpu" / "probes.json.gz", "rt") as f:
        probes = json.load(f)
    for name, f in by.items():
        v, a = f["gate"]["victim"], f["gate"].get("attacker", {})
        totals = [p["total_ms"] for p in probes[f"floods/{name}"]["probes"]]
        done = f["flood"].get("finished", f["flood"].get("calls", ""))
        print(f"| {run} | {name} | {v['gate_pace_sleeps']}, {v['gate_paced_ms']} | {max(totals):.0f} | "
              f"{sum(t > 90 for t in totals)} | {a.get('gate_calls', '')}, {a.get('gate_paced_ms', '')} | {done} |")
