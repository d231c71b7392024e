"""Prints this folder's tables: per run, each flood's ratio (95% interval) and the victim's p95 alone; then per
flood, the victim's p95 under it, its first step in the slowest tenth (ms, tokens) and its decode step, against
the same alone, and the flood's requests finished of submitted.

    python table.py
"""
import glob
import json
from pathlib import Path

here = Path(__file__).parent
order = ["before_1", "after_1", "after_2", "before_2", "before_3", "after_3"]  # the order they ran in
runs = {Path(p).parts[-3]: json.load(open(p))["phases"]["floods"]["by_flood"]
        for p in glob.glob(str(here / "*" / "cpu" / "soak.json"))}
runs = {r: runs[r] for r in order if r in runs}
floods = list(next(iter(runs.values())))
print("| run | p95 alone, ms | " + " | ".join(floods) + " | all within 2x |")
print("| --- " * (3 + len(floods)) + "|")
for run, by in runs.items():
    alone = sorted(f["quiet"]["p95_ms"] for f in by.values())
    cells = [f"{by[n]['ratio']} ({by[n]['ratio_interval'][0]}-{by[n]['ratio_interval'][1]})" for n in floods]
    print(f"| {run} | {alone[0]:.1f}-{alone[-1]:.1f} | " + " | ".join(cells) + f" | {'yes' if all(f['ok'] for f in by.values()) else 'no'} |")
print()
print("| flood | run | p95 under / alone, ms | first step, slowest tenth, ms (tokens) / alone | decode step / alone | "
      "flood finished of submitted |")
print("| --- " * 6 + "|")
for name in floods:
    for run in sorted(runs):
        f = runs[run][name]
        t, q = f["where"]["tail"], f["where_quiet"]["tail"]
        fl = f["flood"]
        done = f"{fl['finished']} of {fl['submitted']}" if "finished" in fl else ""
        print(f"| {name} | {run} | {f['probe']['p95_ms']:.1f} / {f['quiet']['p95_ms']:.1f} | "
              f"{t['first_step_ms']:.1f} ({t['first_step_tokens']:.1f}) / {q['first_step_ms']:.1f} | "
              f"{t['last_step_ms']:.1f} / {q['last_step_ms']:.1f} | {done} |")
