"""The tables of README.md: the decode step by sequences with the threshold dynamic or pinned (steps/), then the
soak's floods alone before and after (soak/): each flood's ratio, the victim's first step under it (median wall
and engine-thread CPU ms) and what the flood finished.

    python table.py
"""
import gzip
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
runs = {side: [json.loads(p.read_text())["median_step_ms_by_batch"]
               for p in sorted((HERE / "steps").glob(f"{side}_*.json"))] for side in ("dynamic", "pinned")}
print("| sequences | dynamic, ms (3 runs) | pinned at 256 KB, ms (3 runs) |\n| --- | --- | --- |")
for b in runs["dynamic"][0]:
    print(f"| {b} | " + " | ".join(", ".join(f"{r[b]:.1f}" for r in runs[side]) for side in runs) + " |")

print("\n| run | flood | ratio | victim's first step under / alone, wall ms | its CPU ms | flood finished |")
print("| --- | --- | --- | --- | --- | --- |")
for side in ("before", "after"):
    for i in (1, 2, 3):
        folder = HERE / "soak" / f"{side}_{i}" / "cpu"
        soak = json.loads((folder / "soak.json").read_text())["phases"]["floods"]["by_flood"]
        probes = json.load(gzip.open(folder / "probes.json.gz"))
        for name, row in soak.items():
            under, alone = probes[f"floods/{name}"]["probes"], probes[f"floods/{name}"]["quiet_probes"]
            med = lambda ps, k: statistics.median(p[k] for p in ps)  # noqa: E731
            flood = row["flood"]
            done = f"{flood['finished']} of {flood['submitted']}" if "finished" in flood else f"{flood.get('calls')} calls"
            print(f"| {side}_{i} | {name} | {row['ratio']:.2f} | {med(under, 'first_step_ms'):.1f} / "
                  f"{med(alone, 'first_step_ms'):.1f} | {med(under, 'first_step_cpu_ms'):.1f} / "
                  f"{med(alone, 'first_step_cpu_ms'):.1f} | {done} |")
