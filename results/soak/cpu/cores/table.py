"""This folder's table: per run and flood, the victim's ratio and the machine's cores in use while its probes ran,
under the flood and alone right before it, by whose processes (soak.json `cpu`, `cpu_quiet`).
python table.py [FOLDER]"""
import json
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)
print("| run | flood | ratio | server (busiest process) | flood's client | soak | rest | machine busy | alone: server, machine |")
print("| --- " * 9 + "|")
for path in sorted(root.glob("*/*/soak.json")):
    for name, f in json.loads(path.read_text())["phases"]["floods"]["by_flood"].items():
        c, q = f["cpu"], f["cpu_quiet"]
        print(f"| {path.relative_to(root).parts[0]} | {name} | {f['ratio']:.2f} | {c['cores']['server']:.2f} "
              f"({c['busiest_process_cores'].get('server', 0):.2f}) | {c['cores']['flood']:.2f} | {c['cores']['soak']:.2f} | "
              f"{c['cores']['other']:.2f} | {c['machine_busy_cores']:.2f} of {c['machine_cores']} | "
              f"{q['cores']['server']:.2f}, {q['machine_busy_cores']:.2f} |")
