"""Prints this folder's table: per run and flood, the victim's p95 ratio (95% interval), its p95 under the flood and
alone (the probes between the floods), its first step's tokens and ms in the slowest tenth under the flood, and the flood's finished requests.

    python table.py [FOLDER]
"""
import glob
import json
import sys
from pathlib import Path

here = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
print("| run | flood | ratio (95% interval) | p95 under / alone, ms | first step under, ms (tokens) | "
      "flood finished of submitted |")
print("| --- " * 6 + "|")
for path in sorted(glob.glob(str(here / "call*" / "*" / "*" / "soak.json"))):
    run = "/".join(Path(path).parts[-4:-2])
    for name, f in json.load(open(path))["phases"]["floods"]["by_flood"].items():
        lo, hi = f["ratio_interval"]
        t = f["where"]["tail"]
        print(f"| {run} | {name} | {f['ratio']} ({lo}-{hi}) | {f['probe']['p95_ms']:.1f} / "
              f"{f['quiet']['p95_ms']:.1f} | {t['first_step_ms']:.1f} ({t['first_step_tokens']:.0f}) | "
              f"{f['flood'].get('finished', '')} of {f['flood'].get('submitted', '')} |")
