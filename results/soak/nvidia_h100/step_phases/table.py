"""Prints this folder's tables: each run's victim slowest tenth per flood, alone and under the flood (ms), with the
host phases of its first step (its prefill) and of its last (its decode), and the in-process first steps.

    python table.py [FOLDER]
"""
import glob
import json
import sys
from pathlib import Path

PHASES = ("inputs", "vision", "forward", "sample", "ahead", "wait")
here = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)


def cell(t, key):
    v = t.get(key)
    return "" if v is None else f"{v:.1f}"


print("| run | flood | ratio | total | first step (CPU) | " + " | ".join(PHASES) + " | last step (CPU) | last: inputs, forward, sample, ahead |")
print("| --- " * (7 + len(PHASES)) + "|")
for path in sorted(glob.glob(str(here / "call*" / "*" / "*" / "soak.json"))):
    run = "/".join(Path(path).parts[-4:-2])
    floods = json.load(open(path))["phases"]["floods"]["by_flood"]
    for name, f in floods.items():
        for label, key in (("alone", "where_quiet"), (name, "where")):
            t = f[key]["tail"]
            cpu = f" ({cell(t, 'first_step_cpu_ms')})" if "first_step_cpu_ms" in t else ""
            last_cpu = f" ({cell(t, 'last_step_cpu_ms')})" if "last_step_cpu_ms" in t else ""
            last = cell(t, "last_step_ms") or f"{t['step_ms'] - t['first_step_ms']:.1f}"
            print(f"| {run} | {label} | {f['ratio'] if key == 'where' else ''} | {cell(t, 'total_ms')} | "
                  f"{cell(t, 'first_step_ms')}{cpu} | " + " | ".join(f"{t['first_' + p + '_ms']:.2f}" for p in PHASES)
                  + f" | {last}{last_cpu} | " + ", ".join(f"{t['last_' + p + '_ms']:.2f}" for p in ("inputs", "forward", "sample", "ahead")) + " |")
print()
print("In process (one engine, no server): the victim's first step, median ms")
print("| file | kind | tokens | first step (CPU) | " + " | ".join(PHASES) + " |")
print("| --- " * (4 + len(PHASES)) + "|")
for path in sorted(p for p in glob.glob(str(here / "**" / "prof_*cuda.json"), recursive=True) if "prof_flood" not in p):
    for kind, row in json.load(open(path)).items():
        cpu = f" ({row['first_step_cpu_ms']:.2f})" if "first_step_cpu_ms" in row else ""
        print(f"| {Path(path).relative_to(here)} | {kind} | {row['first_tokens']:.0f} | {row['first_step_ms']:.2f}{cpu} | "
              + " | ".join(f"{row['first_phases_ms'][p]:.2f}" for p in PHASES) + " |")

print()
print("In process against a flood of one-token picture requests (prof_flood.py): the victim's first step (prefill) and")
print("last (decode), mean over all probes and over the slowest tenth of first steps, ms")
print("| file | victim | rows | first step (CPU) | tokens | inputs | vision | forward | sample | ahead | last step |")
print("| --- " * 11 + "|")
for path in sorted(glob.glob(str(here / "**" / "prof_flood_cuda.json"), recursive=True)):
    for kind, row in json.load(open(path)).items():
        for rows in ("all", "tail"):
            t = row[rows]
            print(f"| {Path(path).parent.relative_to(here)} | {kind} | {rows} | {t['first_step_ms']:.2f} ({t['first_step_cpu_ms']:.2f}) | "
                  f"{t['first_tokens']:.0f} | " + " | ".join(f"{t['first_phases_ms'][p]:.2f}" for p in PHASES[:5])
                  + f" | {t['last_step_ms']:.2f} |")
