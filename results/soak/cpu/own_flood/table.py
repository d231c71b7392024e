"""This folder's tables: per run, the victim's p95 under each flood over its p95 alone right before it (the
ratio the soak checks against 2x; the p95s in ms in brackets), the single-tenant `flood` phase's ratio (to the
soak's baseline), `own64`'s slowest tenth, and where the machine's cores went under each flood.
python table.py [FOLDER]"""
import json
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
FLOODS = ["long", "topup4", "queue2048", "topup32", "poll32", "httppoll32", "own64"]
runs = [(p.relative_to(root).parts[0], json.loads(p.read_text())["phases"]) for p in sorted(root.glob("*/*/soak.json"))]
print("| run | " + " | ".join(FLOODS) + " | flood (one token) |")
print("| --- " * (len(FLOODS) + 2) + "|")
for name, phases in runs:
    by = phases["floods"]["by_flood"]
    cells = []
    for f in FLOODS:
        r = by.get(f)
        if r is None:
            cells.append("")
            continue
        mark = "**" if r["ratio"] > r["max_ratio"] else ""
        cells.append(f"{mark}{r['ratio']:.2f}{mark} ({r['probe']['p95_ms']:.0f} / {r['quiet']['p95_ms']:.0f})")
    legacy = phases.get("flood")
    cells.append(f"{legacy['ratio']:.2f}" if legacy else "")
    print(f"| {name} | " + " | ".join(cells) + " |")
print()
print("| run | first step: tokens, ms (alone) | decode ms, its step's tokens (alone) | submit ms (alone) | "
      "after ms (alone) | total ms (alone) |")
print("| --- | --- | --- | --- | --- | --- |")
for name, phases in runs:
    q = phases["floods"]["by_flood"].get("own64")
    if q is None:
        continue
    t, a = q["where"]["tail"], q["where_quiet"]["tail"]
    print(f"| {name} | {t['first_step_tokens']:.1f}, {t['first_step_ms']:.1f} ({a['first_step_tokens']:.0f}, "
          f"{a['first_step_ms']:.1f}) | {t['decode_ms']:.1f}, {t['step_tokens'] - t['first_step_tokens']:.1f} "
          f"({a['decode_ms']:.1f}, {a['step_tokens'] - a['first_step_tokens']:.0f}) | {t['submit_ms']:.1f} "
          f"({a['submit_ms']:.1f}) | {t['after_ms']:.1f} ({a['after_ms']:.1f}) | {t['total_ms']:.1f} ({a['total_ms']:.1f}) |")
print()
print("cores busy under each flood (alone): the machine's; the server's process tree; its busiest process; the flood's")
print("| run | " + " | ".join(FLOODS) + " |")
print("| --- " * (len(FLOODS) + 1) + "|")
for name, phases in runs:
    cells = []
    for f in FLOODS:
        r = phases["floods"]["by_flood"].get(f)
        if r is None or not r.get("cpu"):
            cells.append("")
            continue
        c, q = r["cpu"], r["cpu_quiet"]
        cells.append(f"{c['machine_busy_cores']:.2f} ({q['machine_busy_cores']:.2f}); {c['cores']['server']:.2f}; "
                     f"{c['busiest_process_cores']['server']:.2f}; {c['cores']['flood']:.2f}")
    print(f"| {name} | " + " | ".join(cells) + " |")
