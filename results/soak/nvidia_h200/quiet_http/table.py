"""This folder's table: per run, per flood, the victim's p95 under the flood over its p95 alone right before it
(the ratio the soak checks against 2x), then both p95s in ms and the flood's first-step tokens and time in the
slowest tenth of probes.  python table.py [FOLDER]"""
import json
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
FLOODS = ["long", "topup4", "queue2048", "topup32", "poll32", "httppoll32"]
print("| run | " + " | ".join(FLOODS) + " |")
print("| --- " * (len(FLOODS) + 1) + "|")
for path in sorted(root.glob("*/*/soak.json")):
    by = json.loads(path.read_text())["phases"]["floods"]["by_flood"]
    cells = []
    for f in FLOODS:
        if f not in by:
            cells.append("")
            continue
        r = by[f]
        mark = "**" if r["ratio"] > r["max_ratio"] else ""
        cells.append(f"{mark}{r['ratio']:.2f}{mark} ({r['probe']['p95_ms']:.0f} / {r['quiet']['p95_ms']:.0f})")
    print(f"| {path.relative_to(root).parts[0]} | " + " | ".join(cells) + " |")
print()
print("queue2048, slowest tenth of probes: first step (tokens, ms), decode ms, total ms; alone in brackets")
for path in sorted(root.glob("*/*/soak.json")):
    q = json.loads(path.read_text())["phases"]["floods"]["by_flood"]["queue2048"]
    t, a = q["where"]["tail"], q["where_quiet"]["tail"]
    print(f"  {path.relative_to(root).parts[0]:12s} quiet steps {q['quiet_steps']:3d}: "
          f"{t['first_step_tokens']:.1f} tok {t['first_step_ms']:.1f} ms ({a['first_step_tokens']:.0f} tok "
          f"{a['first_step_ms']:.1f} ms), decode {t['decode_ms']:.1f} ({a['decode_ms']:.1f}), "
          f"total {t['total_ms']:.1f} ({a['total_ms']:.1f})")
