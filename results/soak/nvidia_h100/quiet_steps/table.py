"""Prints this folder's table: per run and flood, the victim's p95 ratio (95% interval), its p95 under the flood and
alone (the probes right before the flood), its first step's ms and tokens in the slowest tenth under the flood, the
flood's quiet steps and its finished requests. `b_*` runs had quiet steps on at rate 1; the others the defaults.

    python table.py [FOLDER]
"""
import glob
import json
import sys
from pathlib import Path

here = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
print("| run | quiet steps | flood | ratio (95% interval) | p95 under / alone, ms | first step under, ms (tokens) | "
      "quiet steps taken | flood finished of submitted |")
print("| --- " * 8 + "|")
for path in sorted(glob.glob(str(here / "call*" / "*" / "*" / "soak.json"))):
    run = "/".join(Path(path).parts[-4:-2])
    setting = "on, rate 1" if "/b_" in run else "off"
    for name, f in json.load(open(path))["phases"]["floods"]["by_flood"].items():
        lo, hi = f["ratio_interval"]
        t = f["where"]["tail"]
        ratio = f"**{f['ratio']}**" if f["ratio"] > 2 else f["ratio"]
        print(f"| {run} | {setting} | {name} | {ratio} ({lo}-{hi}) | {f['probe']['p95_ms']:.1f} / "
              f"{f['quiet']['p95_ms']:.1f} | {t['first_step_ms']:.1f} ({t['first_step_tokens']:.0f}) | "
              f"{f.get('quiet_steps', '')} | {f['flood'].get('finished', '')} of {f['flood'].get('submitted', '')} |")
