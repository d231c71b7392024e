"""The table of README.md: each run's ratio under each flood, the victim's p95 under it and alone (ms), and the
victim's first step under it (median engine-thread CPU ms).

    python table.py
"""
import gzip
import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent
print("| run | threads | flood | ratio (95% interval) | p95 under / alone, ms | first step CPU under / alone, ms |")
print("| --- | --- | --- | --- | --- | --- |")
for folder in sorted(HERE.glob("t*_*"), key=lambda p: (p.name.split("_")[1], "21a".index(p.name[1]))):
    if not folder.is_dir():
        continue
    soak = json.loads((folder / "cpu" / "soak.json").read_text())["phases"]["floods"]["by_flood"]
    probes = json.load(gzip.open(folder / "cpu" / "probes.json.gz"))
    for name, row in soak.items():
        under, alone = probes[f"floods/{name}"]["probes"], probes[f"floods/{name}"]["quiet_probes"]
        cpu = [statistics.median(p["first_step_cpu_ms"] for p in ps) for ps in (under, alone)]
        low, high = row["ratio_interval"]
        threads = {"1": "1", "2": "2", "a": "auto"}[folder.name[1]]
        print(f"| {folder.name} | {threads} | {name} | {row['ratio']:.2f} ({low}-{high}) | "
              f"{row['probe']['p95_ms']:.1f} / {row['quiet']['p95_ms']:.1f} | {cpu[0]:.1f} / {cpu[1]:.1f} |")
