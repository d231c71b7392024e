"""A YOLO teacher used from Python (no `vlora` command to pin anything) keeps ultralytics' settings
and fonts and matplotlib's cache under VLORA_HOME: a second run, which finds the trained weights
cached and skips training, once imported ultralytics with its defaults under ~/.config."""

from __future__ import annotations

import subprocess
import sys

from yolo_cache import files, user_env, write_cached_yolo_world

SCRIPT = """\
import sys
import numpy as np
from train.teachers import TeacherSettings, build_teacher

teacher = build_teacher("yolo_world", TeacherSettings(dir=sys.argv[1]))
print("boxes", len(teacher.detect(np.zeros((64, 64, 3), np.uint8))))
"""


def test_a_cached_yolo_world_teacher_writes_nothing_outside_vlora_home(tmp_path):
    user, home, work = tmp_path / "user", tmp_path / "home", tmp_path / "work"
    user.mkdir()
    work.mkdir()
    write_cached_yolo_world(home / "teachers", tmp_path / "scratch")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(home / "teachers")], cwd=work, env=user_env(user, home),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "boxes" in done.stdout, done.stderr[-2000:]
    assert files(user) == [] and files(work) == []
    assert (home / "teachers" / "ultralytics").is_dir() and (home / "matplotlib").is_dir()
