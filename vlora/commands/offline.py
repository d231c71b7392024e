"""`vlora offline`: the whole offline stage on the built-in default (conf/offline.yaml).

    vlora offline                       # teachers -> datasets -> fused adapters -> report
    vlora offline offline.per_domain=false offline.all_in_one=false    # fusion only, short report

Every step keeps what an earlier run finished (teachers, datasets, the world pretraining of the
tiny model, the fusion journal), so a second run only redoes the report's extra trainings.
Outputs: ${paths.adapters}/fused/ (adapters + manifest.json) and ${offline.report_dir}/
(report.json, report.md, report.png, and offline.log: what the steps wrote, ultralytics' training
and progress lines included; the console gets one line per step, then the report; `verbose=true`:
everything on the console too).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from . import distill as distill_command
from .capture import command_stages
from .fusion import run_fusion
from .offline_report import build_report, write_report


def run(cfg: DictConfig) -> dict:
    start = time.perf_counter()
    timings = {}
    log = Path(cfg.offline.report_dir) / "offline.log"
    with command_stages("offline", log, bool(cfg.get("verbose", False))) as say:
        say("[offline 1/3] teachers and distilled datasets (minutes the first time; a later run reuses them)")
        distill_command.run(cfg)
        timings["distill_s"] = time.perf_counter() - start
        say("[offline 2/3] knowledge fusion: LoRA adapters with task heads")
        fused = run_fusion(cfg)
        timings["fusion_s"] = fused["seconds"]
        say("[offline 3/3] report")
        mark = time.perf_counter()
        report = build_report(cfg, fused, fused["trainer"])
        timings["report_s"] = time.perf_counter() - mark
        timings["total_s"] = time.perf_counter() - start
        report["timings_s"] = {k: round(v, 1) for k, v in timings.items()}
        report["model_path"] = str(fused["model"].path)  # the base the adapters were trained on: serve that one
        out = write_report(report, cfg.offline.report_dir)
    print(f"\nOffline stage: {report['adapters']['fused']} fused adapters for {len(report['domains'])} domains in "
          f"{timings['total_s']:.0f} s; report in {out}", file=sys.stderr, flush=True)
    print((out / "report.md").read_text())
    return report
