"""A teacher run by another interpreter (`kind: process`): the same labels as in this process, a
clear error when its worker dies or hangs, and a cache key that follows the code it loaded.

The other interpreter is a venv made here without this environment's site-packages; numpy is
installed into it from a local wheel (or, failing that, linked in alone), so the worker runs with
neither torch nor this project importable. The teacher's package is written into the test's folder
and is never imported by this process while the process teacher runs."""

from __future__ import annotations

import glob
import importlib
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import cv2
import numpy as np
import pytest
from datasets import load_from_disk

from train.teachers import Query, Sample, TeacherError, TeacherSettings, build_teacher, teacher_fingerprint
from train.teachers.process import ProcessTeacherError

GREYS = (10, 60, 110, 160, 210, 250)

TILES = '''import os, sys, time


class Tiles:
    """Boxes of the bright 8x8 tiles (a stand-in for a HOG people detector)."""

    classes = ("tile",)
    name = "tiles"

    def __init__(self, threshold=100, crash_at=None, hang=False):
        self.threshold, self.crash_at, self.hang, self.seen = threshold, crash_at, hang, 0

    def detect(self, frame):
        self.seen += 1
        if self.crash_at is not None and self.seen >= self.crash_at:
            print("tiles: about to crash on frame", self.seen, file=sys.stderr, flush=True)
            os._exit(3)
        if self.hang:
            print("tiles: waiting forever", flush=True)  # a print to stdout must not break the protocol
            time.sleep(600)
        out = []
        for y in range(0, frame.shape[0] - 7, 8):
            for x in range(0, frame.shape[1] - 7, 8):
                if frame[y:y + 8, x:x + 8].mean() > self.threshold:
                    out.append(("tile", 0.9, (x, y, x + 8, y + 8)))
        return out


class Probe:
    """Says which of this project's imports the interpreter it runs in can see."""

    def classify(self, frame):
        import importlib.util
        seen = [m for m in ("torch", "train", "vlora", "cv2") if importlib.util.find_spec(m) is not None]
        return ",".join(seen) or "none"
'''


def _install_numpy(python: Path, site: Path) -> str:
    """numpy into the venv: from a local wheel of this numpy's version where one is found, else
    linked in from this environment (numpy alone: nothing else of it becomes importable)."""
    wheels = [w for d in (os.environ.get("PIP_FIND_LINKS", ""), str(Path.home() / ".cache/pip"))
              for w in glob.glob(f"{d}/**/numpy-{np.__version__}-*.whl", recursive=True) if d]
    sources = ([["--no-index", "--find-links", str(Path(wheels[0]).parent)]] if wheels else []) + [[]]
    for source in sources:
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                               *source, f"numpy=={np.__version__}"], capture_output=True, timeout=180)
        if done.returncode == 0:
            return "pip"
    numpy_dir = Path(np.__file__).parent
    for src in (numpy_dir, numpy_dir.with_name("numpy.libs")):
        if src.exists():
            (site / src.name).symlink_to(src)
    return "linked"


@pytest.fixture(scope="module")
def other_python(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("other_env")
    venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True).create(root / "venv")
    python = root / "venv" / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    _install_numpy(python, site)
    return python


@pytest.fixture
def user(tmp_path) -> Path:
    root = tmp_path / "user"
    (root / "shades").mkdir(parents=True)
    (root / "shades" / "__init__.py").write_text("")
    (root / "shades" / "tiles.py").write_text(TILES)
    shots = root / "shots"
    shots.mkdir()
    for i, grey in enumerate(GREYS):
        img = np.zeros((24, 32, 3), np.uint8)
        img[:, : 8 * (i % 4 + 1)] = grey  # 1-4 tiles wide, of six brightnesses
        cv2.imwrite(str(shots / f"{i}.png"), img)
    yield root
    for name in [n for n in sys.modules if n == "shades" or n.startswith("shades.")]:
        del sys.modules[name]


def _spec(python: Path, user: Path, target: str = "shades.tiles.Tiles", **extra) -> dict:
    return {"kind": "process", "python": str(python), "target": target, "path": [str(user)], **extra}


def _override(value) -> str:
    """A value in Hydra's override grammar (JSON's quoted keys are not part of it)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_override(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_override(v) for v in value) + "]"
    return f"'{value}'" if isinstance(value, str) else json.dumps(value)


@pytest.fixture(scope="module")
def zoo_path(vlora_home):
    from zoo import build_checkpoint

    return build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")


def _distill(home: Path, zoo: Path, user: Path, teacher: dict) -> tuple[list, dict]:
    """(rows by image: count and boxes, domain.json) of one `vlora distill` of a count domain."""
    from vlora.commands import distill as distill_cmd
    from vlora.config import compose

    domain = _override({"name": "tiles", "task": "count", "target": "count", "question": "How many tiles?",
                         "teacher": teacher, "source": {"kind": "images", "path": str(user / "shots")}})
    cfg = compose("distill", [f"paths.home={home}", f"model.path={zoo}", f"+distill.domains.tiles={domain}",
                              "distill.only=[tiles]", "teachers.process.batch=4"])
    assert distill_cmd.run(cfg)["tiles"].status == "built"
    dd = load_from_disk(str(home / "datasets" / "tiles"))
    rows = sorted(list(dd["train"]) + list(dd["eval"]), key=lambda r: r["id"])
    return [(r["id"], r["count"]) for r in rows], json.loads((home / "datasets" / "tiles" / "domain.json").read_text())


def test_distillation_through_another_interpreter_matches_the_same_class_here(tmp_path, zoo_path, other_python,
                                                                               user, monkeypatch):
    zoo = zoo_path
    remote, meta = _distill(tmp_path / "remote", zoo, user, _spec(other_python, user, args={"threshold": 100}))
    assert "shades" not in sys.modules, "the teacher ran in the other interpreter only"
    assert meta["teacher"]["kind"] == "process" and str(other_python) in meta["teacher"]["detail"]
    assert sorted(meta["key"]["teacher"]["code"]) == ["shades/__init__.py", "shades/tiles.py"]
    monkeypatch.syspath_prepend(str(user))
    here, _ = _distill(tmp_path / "here", zoo, user, {"_target_": "shades.tiles.Tiles", "threshold": 100})
    assert remote == here and len(here) == len(GREYS)
    assert [c for _, c in here] != [0] * len(GREYS), "the teacher found tiles"


def test_the_worker_runs_without_this_environment(tmp_path, other_python, user):
    settings = TeacherSettings(dir=str(tmp_path))
    with build_teacher(_spec(other_python, user, target="shades.tiles.Probe"), settings) as probe:
        answer = probe.answer(Sample("a", "image", [np.zeros((8, 8, 3), np.uint8)]), Query("class"))
        assert answer.label == "none", f"the worker could import {answer.label}"
        assert probe.ready["prefix"] == str(other_python.parent.parent)
        assert probe.ready["python"] == ".".join(map(str, sys.version_info[:3]))


def test_the_key_follows_the_interpreter_and_the_code_it_loads(tmp_path, other_python, user):
    settings = TeacherSettings(dir=str(tmp_path))
    with build_teacher(_spec(other_python, user), settings) as t:
        before = teacher_fingerprint(t)
    (user / "shades" / "tiles.py").write_text(TILES.replace("threshold=100", "threshold=120"))
    with build_teacher(_spec(other_python, user), settings) as t:
        assert teacher_fingerprint(t) != before, "the target's source as the worker loaded it"
    link = tmp_path / "python-link"
    link.symlink_to(other_python)
    with build_teacher(_spec(link, user), settings) as t:
        edited = teacher_fingerprint(t)
    with build_teacher(_spec(other_python, user), settings) as t:
        assert teacher_fingerprint(t) != edited, "the interpreter's path"


def test_a_worker_that_dies_mid_batch_names_the_interpreter_and_its_stderr(tmp_path, other_python, user):
    teacher = build_teacher(_spec(other_python, user, args={"crash_at": 3}, batch=4), TeacherSettings(dir=str(tmp_path)))
    frames = [np.zeros((16, 16, 3), np.uint8)] * 4
    with pytest.raises(ProcessTeacherError) as err:
        teacher.detect_batch(frames)
    text = str(err.value)
    assert str(other_python) in text and "died during a detect message of 4 frames (exit status 3)" in text
    assert "tiles: about to crash on frame 3" in text
    with pytest.raises(ProcessTeacherError, match="died during"):
        teacher.detect_batch(frames[:1])  # a dead worker keeps saying so
    teacher.close()


def test_a_worker_that_hangs_times_out_and_is_stopped(tmp_path, other_python, user):
    teacher = build_teacher(_spec(other_python, user, args={"hang": True}, timeout_s=1),
                            TeacherSettings(dir=str(tmp_path)))
    with pytest.raises(ProcessTeacherError, match=r"did not answer a detect message of 1 frame within 1 s") as err:
        teacher.answer(Sample("a", "image", [np.zeros((8, 8, 3), np.uint8)]), Query("count"))
    assert "tiles: waiting forever" in str(err.value), "the teacher's stdout went to the stderr tail"
    assert teacher.worker.proc.poll() is not None
    teacher.close()


def test_bad_specs_fail_before_anything_starts(tmp_path, other_python, user):
    from train.teachers import teacher_targets

    settings = TeacherSettings(dir=str(tmp_path))
    with pytest.raises(TeacherError, match=r"python '/no/such/python' is not an executable file"):
        teacher_targets(_spec(Path("/no/such/python"), user), settings)
    with pytest.raises(TeacherError, match=r"target must be a dotted path \(module.Class\), got 'Tiles'"):
        teacher_targets(_spec(other_python, user, target="Tiles"), settings)
    with pytest.raises(TeacherError, match=r"unknown keys \['threads'\]"):
        teacher_targets(_spec(other_python, user, threads=2), settings)
    assert teacher_targets(_spec(other_python, user), settings) is None, "its worker tells, once started"
    with pytest.raises(ProcessTeacherError, match=r"shades.nope.Tiles could not be built there: "
                                                  r"ModuleNotFoundError: No module named 'shades.nope'"):
        build_teacher(_spec(other_python, user, target="shades.nope.Tiles"), settings)
    importlib.invalidate_caches()
