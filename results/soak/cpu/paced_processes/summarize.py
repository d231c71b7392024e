"""The table of a folder's README from its runs' soak.json (runs: folders named SETTING_N): per run, the victim's p95 alone and, per flood,
the ratio to it and the loaded p95 (ms); then per setting, the runs meeting 2x under every flood and the
median of each flood's ratio and loaded p95.  python summarize.py [FOLDER]"""
import json
import statistics
import sys
from pathlib import Path

FLOODS = ["long", "topup4", "queue2048", "topup32", "poll32"]
root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
runs = {}
for path in sorted(root.glob("*/soak.json")) + sorted(root.glob("*/*/soak.json")):
    name = path.relative_to(root).parts[0]
    if not name.rsplit("_", 1)[-1].isdigit():  # not a run of a setting (NAME_N): a folder of another kind
        continue
    by = json.loads(path.read_text())["phases"]["floods"]["by_flood"]
    if all(f in by for f in FLOODS):
        runs[name] = by
print("| run | p95 alone | " + " | ".join(FLOODS) + " | all within 2x |")
print("| --- " * (len(FLOODS) + 3) + "|")
key = lambda n: (n.rsplit("_", 1)[0], int(n.rsplit("_", 1)[1]))
for name in sorted(runs, key=key):
    by = runs[name]
    cells = [f"{by[f]['ratio']:.2f} ({by[f]['ratio'] * by[f]['unloaded_p95_ms']:.0f})" for f in FLOODS]
    ok = all(by[f]["ok"] for f in FLOODS)
    print(f"| {name} | {by['topup32']['unloaded_p95_ms']:.1f} | " + " | ".join(cells) + f" | {'yes' if ok else 'no'} |")
print()
for arm in sorted({key(n)[0] for n in runs}):
    mine = [runs[n] for n in runs if key(n)[0] == arm]
    met = sum(all(by[f]["ok"] for f in FLOODS) for by in mine)
    parts = []
    for f in FLOODS:
        ratios = [by[f]["ratio"] for by in mine]
        loaded = [by[f]["ratio"] * by[f]["unloaded_p95_ms"] for by in mine]
        within = sum(r <= 2 for r in ratios)
        parts.append(f"{f} {statistics.median(ratios):.2f}x ({within}/{len(mine)} within 2x), "
                     f"loaded {statistics.median(loaded):.0f} ms")
    alone = statistics.median(by["topup32"]["unloaded_p95_ms"] for by in mine)
    print(f"{arm}: {met}/{len(mine)} runs within 2x under every flood; p95 alone {alone:.1f} ms; " + "; ".join(parts))
