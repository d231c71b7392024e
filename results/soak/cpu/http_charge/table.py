import json, sys
from pathlib import Path
root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
print("| run | poll32 | httppoll32 | httppoll32 calls | its victim steps, slowest tenth (ms) |")
print("| --- | --- | --- | --- | --- |")
for arm in ("before", "after"):
    for i in (1, 2, 3):
        p = root / f"{arm}_{i}" / "cpu" / "soak.json"
        if not p.exists():
            continue
        by = json.loads(p.read_text())["phases"]["floods"]["by_flood"]
        cells = []
        for f in ("poll32", "httppoll32"):
            v = by[f]
            cells.append(f"{v['ratio']:.2f} ({v['probe']['p95_ms']:.0f} of {v['quiet']['p95_ms']:.0f})")
        h = by["httppoll32"]
        print(f"| {arm}_{i} | " + " | ".join(cells) + f" | {h['flood'].get('calls', 0)} | {h['where']['tail']['step_ms']:.1f} |")
