"""`vlora offline`: the whole offline stage on the built-in default (conf/offline.yaml).

    vlora offline                       # teachers -> datasets -> fused adapters -> report
    vlora offline offline.per_domain=false offline.all_in_one=false    # fusion only, short report

Every step keeps what an earlier run finished (teachers, datasets, the world pretraining of the
tiny model, the fusion journal), so a second run only redoes the report's extra trainings.
Outputs: ${paths.adapters}/fused/ (adapters + manifest.json) and ${offline.report_dir}/
(report.json, report.md, report.png).
"""

from __future__ import annotations

import sys
import time

from omegaconf import DictConfig

from . import distill as distill_command
from .fusion import run_fusion
from .offline_report import build_report, write_report


def run(cfg: DictConfig) -> dict:
    start = time.perf_counter()
    timings = {}
    distill_command.run(cfg)
    timings["distill_s"] = time.perf_counter() - start
    fused = run_fusion(cfg)
    timings["fusion_s"] = fused["seconds"]
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
