"""A cached `yolo_world` teacher (an untrained detector where `vlora teachers` keeps the trained one,
with the record that makes a second run reuse it), written by a subprocess so that this process
never imports ultralytics with settings of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# set in a user's environment or not: the libraries' own defaults under HOME must not apply in tests
UNSET = ("YOLO_CONFIG_DIR", "MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "VLORA_TOKEN")

_SCRIPT = """\
import json, sys
from pathlib import Path
from train.teachers.yolo_world import RECORD, WEIGHTS, YoloWorldSpec, save_untrained_yolo
from world import WorldConfig

classes = WorldConfig().classes
out = Path(sys.argv[1])
save_untrained_yolo(out / WEIGHTS, classes)
(out / RECORD).write_text(json.dumps({"fingerprint": YoloWorldSpec().fingerprint(), "classes": list(classes)}))
"""


def user_env(user: Path, home: Path, **extra: str) -> dict:
    """The environment of a user whose home directory is `user` and whose VLORA_HOME is `home`."""
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    return {**env, "HOME": str(user), "VLORA_HOME": str(home), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **extra}


def write_cached_yolo_world(teachers_dir: Path, scratch: Path) -> Path:
    env = user_env(scratch, scratch / "vlora", YOLO_CONFIG_DIR=str(scratch / "yolo"), MPLCONFIGDIR=str(scratch / "mpl"))
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(teachers_dir / "yolo_world")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return teachers_dir / "yolo_world"


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
