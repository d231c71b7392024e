"""The table of an HTTP flood's A/B folder (runs before_N, after_N): the victim's ratio under poll32 and under the
HTTP flood, what the flood did, and the victim's engine steps in its slowest tenth.
python table.py [FOLDER] [FLOOD]   (defaults: this folder, httppoll32)"""
import json
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
flood = sys.argv[2] if len(sys.argv) > 2 else "httppoll32"
print(f"| run | poll32 | {flood} | {flood} requests answered | the flood's reconnects | victim's steps, slowest tenth (ms) |")
print("| --- | --- | --- | --- | --- | --- |")
for arm in ("before", "after"):
    for i in (1, 2, 3):
        p = root / f"{arm}_{i}" / "cpu" / "soak.json"
        if not p.exists():
            continue
        by = json.loads(p.read_text())["phases"]["floods"]["by_flood"]
        cells = [f"{by[f]['ratio']:.2f} ({by[f]['probe']['p95_ms']:.0f} of {by[f]['quiet']['p95_ms']:.0f})"
                 for f in ("poll32", flood)]
        h = by[flood]
        answered = h["flood"].get("calls", 0) + h["flood"].get("http_401", 0)
        print(f"| {arm}_{i} | " + " | ".join(cells) + f" | {answered} | {h['flood'].get('reconnects', 0)} | "
              f"{h['where']['tail']['step_ms']:.1f} |")
