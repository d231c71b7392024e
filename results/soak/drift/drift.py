"""How far the victim's p95 alone moved across each flood, over every committed GPU soak: each flood's window alone
before it against the one after it (the next flood's window before; the last flood of a run has none in runs made
before the soak took one more window at the end). Prints the spread of after / before, and each row whose ratio
missed 2x with its ratio to the window after.

    python results/soak/drift/drift.py [KIND]   (KIND: a folder pattern under results/soak, nvidia_* by default)
"""
import glob
import json
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
kind = sys.argv[1] if len(sys.argv) > 1 else "nvidia_*"
drifts, misses = [], []
for path in sorted(glob.glob(str(root / kind / "**" / "soak.json"), recursive=True)):
    floods = list(json.load(open(path)).get("phases", {}).get("floods", {}).get("by_flood", {}).items())
    for i, (name, f) in enumerate(floods):
        before, probe = f.get("quiet"), f.get("probe")
        after = f.get("quiet_after", floods[i + 1][1].get("quiet") if i + 1 < len(floods) else None)
        if not (before and probe):
            continue
        if after:
            drifts.append(after["p95_ms"] / before["p95_ms"])
        if f["ratio"] > 2:
            run = str(Path(path).relative_to(root).parent)
            misses.append((run, name, f["ratio"], before["p95_ms"], after["p95_ms"] if after else None,
                           round(probe["p95_ms"] / after["p95_ms"], 2) if after else None))
drifts.sort()
at = {q: round(drifts[round(q * (len(drifts) - 1))], 2) for q in (0, 0.05, 0.25, 0.5, 0.75, 0.95, 1)}
print(f"{len(drifts)} floods with a window alone before and after; after / before at quantiles {at}")
print("| run | flood | ratio | p95 alone before, ms | after, ms | p95 under / after |")
print("| --- | --- | --- | --- | --- | --- |")
for run, name, ratio, before, after, to_after in misses:
    print(f"| {run} | {name} | {ratio} | {before} | {after if after is not None else ''} | "
          f"{to_after if to_after is not None else ''} |")
