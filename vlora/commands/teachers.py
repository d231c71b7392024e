"""`vlora teachers`: train (or reuse) the built-in teachers on the synthetic world.

Trains the YOLO detector, fits the scikit-learn and torch classifiers (each cached under
${paths.home}/teachers/<name>/ with its held-out metrics in teacher.json), then prints a table
and writes ${paths.home}/teachers/report.json. A second run reuses every cached teacher.
What the training writes (ultralytics' logger and progress, the classifiers' epochs) goes to
${paths.home}/teachers/teachers.log; the console gets one line per teacher, then the table
(`verbose=true`: everything on the console too).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from train.teachers import BUILTIN, TRAINED, TeacherSettings, build_teacher

from .capture import command_stages
from .table import format_table


def teacher_settings(cfg: DictConfig) -> TeacherSettings:
    return TeacherSettings.from_dict(OmegaConf.to_container(cfg.teachers, resolve=True))


def _summary(name: str, settings: TeacherSettings, seconds: float) -> dict:
    rec_path = Path(settings.dir) / name / "teacher.json"
    rec = json.loads(rec_path.read_text()) if rec_path.is_file() else {}
    if "val" in rec:  # the YOLO detector
        metric, value = "val mAP50", rec["val"]["map50"]
        trained = rec.get("train_seconds")
    else:
        metric, value = ("val accuracy", rec["val_accuracy"]) if "val_accuracy" in rec else ("-", None)
        trained = rec.get("fit_seconds")
    return {"teacher": name, "kind": BUILTIN[name], "metric": metric, "value": value,
            "train_s": trained, "this_run_s": round(seconds, 1), "dir": str(rec_path.parent)}


def run(cfg: DictConfig) -> list[dict]:
    settings = teacher_settings(cfg)
    names = list(cfg.build)
    bad = [n for n in names if n not in TRAINED]
    if bad:
        raise ValueError(f"build lists {bad}; the teachers `vlora teachers` trains are {list(TRAINED)}")
    rows = []
    with command_stages("teachers", Path(settings.dir) / "teachers.log", bool(cfg.get("verbose", False))) as say:
        for i, name in enumerate(names, 1):
            say(f"[teachers {i}/{len(names)}] {name} ({BUILTIN[name]}): trained once, then reused from "
                f"{Path(settings.dir) / name}")
            start = time.perf_counter()
            build_teacher(name, settings, sys.stderr)
            rows.append(_summary(name, settings, time.perf_counter() - start))
    report = Path(settings.dir) / "report.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(rows, indent=2) + "\n")
    print("\nTeachers trained on the synthetic world (held-out metrics)\n")
    print(format_table([{k: v for k, v in r.items() if k != "dir"} for r in rows]))
    print(f"\nreport: {report}")
    return rows
