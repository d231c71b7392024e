"""Distillation's cache key covers a plug-in teacher's code, its arguments and its checkpoint.

The user's teacher is a package the test writes into its own folder (`my_models.people`, which
imports a helper from `my_models.util`); every domain is given as Hydra overrides of the real
`distill` config and distilled by the command's run(), as `vlora distill` would. Each run is a
fresh process there, so the package is imported anew before each run here."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
from datasets import load_from_disk

GREYS = (10, 60, 110, 160, 210, 250)  # one image each: the teacher counts brightness levels

PEOPLE = '''from .util import level


class PeopleCounter:
    """A user's counter with a tunable step (a stand-in for a detector's threshold)."""

    classes = ("person",)

    def __init__(self, step: int = {step}, floor: int = 0, checkpoint: str | None = None):
        self.step, self.floor = step, floor
        self.offset = int(open(checkpoint).read()) if checkpoint else 0  # the "weights"

    def count(self, frame):
        return max(level(frame, self.step) - self.floor, 0) + self.offset
'''
UTIL = '''def level(frame, step):
    return int(frame.mean()) // step
'''


@pytest.fixture(scope="module")
def zoo_path(vlora_home):
    from zoo import build_checkpoint

    return build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")


@pytest.fixture
def user(tmp_path, monkeypatch) -> Path:
    """The user's folder: the teacher package, a checkpoint it reads, and six images."""
    root = tmp_path / "user"
    pkg = root / "my_models"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "people.py").write_text(PEOPLE.format(step=50))
    (pkg / "util.py").write_text(UTIL)
    (root / "people.ckpt").write_text("0")
    shots = root / "shots"
    shots.mkdir()
    for i, grey in enumerate(GREYS):
        cv2.imwrite(str(shots / f"{i}.png"), np.full((24, 32, 3), grey, np.uint8))
    monkeypatch.syspath_prepend(str(root))  # as a user puts their teacher's folder on PYTHONPATH
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # an edit within the same second is still read
    yield root
    _forget_package()


def _forget_package() -> None:
    for name in [n for n in sys.modules if n == "my_models" or n.startswith("my_models.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def _domain(user: Path, **args) -> str:
    extra = "".join(f", {k}: {v}" for k, v in args.items())
    teacher = f"{{_target_: my_models.people.PeopleCounter, checkpoint: '{user / 'people.ckpt'}'{extra}}}"
    return (f"{{name: people, task: count, target: count, question: 'How many people are there?', "
            f"teacher: {teacher}, source: {{kind: images, path: '{user / 'shots'}'}}}}")


def _run(home: Path, zoo: Path, domain: str, capsys) -> tuple[str, list[int], str]:
    """(status, counts by image, the run's log) of one `vlora distill` of the domain."""
    from vlora.commands import distill as distill_cmd
    from vlora.config import compose

    _forget_package()  # a new process imports the user's files as they are now
    capsys.readouterr()
    cfg = compose("distill", [f"paths.home={home}", f"model.path={zoo}", f"+distill.domains.people={domain}",
                              "distill.only=[people]"])
    status = distill_cmd.run(cfg)["people"].status
    dd = load_from_disk(str(home / "datasets" / "people"))
    rows = sorted(list(dd["train"]) + list(dd["eval"]), key=lambda r: r["id"])
    return status, [r["count"] for r in rows], capsys.readouterr().err


def test_a_changed_teacher_rebuilds_and_says_why(tmp_path, zoo_path, user, capsys):
    home = tmp_path / "home"
    status, counts, _ = _run(home, zoo_path, _domain(user, floor=0), capsys)
    assert status == "built" and counts == [0, 1, 2, 3, 4, 5]
    key = json.loads((home / "datasets" / "people" / "domain.json").read_text())["key"]
    assert sorted(key["teacher"]["code"]) == ["my_models/__init__.py", "my_models/people.py", "my_models/util.py"]
    assert list(key["teacher"]["checkpoints"]) == [str(user / "people.ckpt")]

    status, _, log = _run(home, zoo_path, _domain(user, floor=0), capsys)
    assert status == "kept" and "kept" in log

    (user / "my_models" / "people.py").write_text(PEOPLE.format(step=100))  # the default parameter
    status, counts, log = _run(home, zoo_path, _domain(user, floor=0), capsys)
    assert status == "built" and counts == [0, 0, 1, 1, 2, 2], "the labels come from the edited code"
    assert "rebuilding" in log and "the teacher's code changed (my_models/people.py)" in log
    assert _run(home, zoo_path, _domain(user, floor=0), capsys)[0] == "kept"

    (user / "my_models" / "util.py").write_text(UTIL.replace("int(frame.mean()) //", "(int(frame.mean()) + 50) //"))
    status, counts, log = _run(home, zoo_path, _domain(user, floor=0), capsys)
    assert status == "built" and counts == [0, 1, 1, 2, 2, 3], "a module the teacher imports counts too"
    assert "the teacher's code changed (my_models/util.py)" in log

    status, counts, log = _run(home, zoo_path, _domain(user, floor=1), capsys)
    assert status == "built" and counts == [0, 0, 0, 1, 1, 2]
    assert "the teacher's arguments changed (floor 0 -> 1)" in log and "code changed" not in log

    (user / "people.ckpt").write_text("10")
    status, counts, log = _run(home, zoo_path, _domain(user, floor=1), capsys)
    assert status == "built" and counts == [10, 10, 10, 11, 11, 12]
    assert f"the teacher's checkpoint changed ({user / 'people.ckpt'})" in log
    assert "arguments changed" not in log and "code changed" not in log
    assert _run(home, zoo_path, _domain(user, floor=1), capsys)[0] == "kept"


def test_checkpoint_hashes_are_cached_by_path_size_and_mtime(tmp_path):
    from train.teachers.provenance import FileHashes

    ckpt, cache = tmp_path / "big.bin", tmp_path / "hashes.json"
    ckpt.write_bytes(b"a" * 4096)
    hashes = FileHashes(cache)
    first = hashes.digest(ckpt)
    hashes.save()
    stat = ckpt.stat()
    ckpt.write_bytes(b"b" * 4096)  # same size; the old mtime put back: only a re-read would notice
    os.utime(ckpt, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert FileHashes(cache).digest(ckpt) == first, "a later run takes the recorded hash, not the bytes"
    os.utime(ckpt, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert FileHashes(cache).digest(ckpt) != first, "a touched checkpoint is hashed again"
    folder = tmp_path / "ckpt_dir"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "w.bin").write_bytes(b"x")
    before = FileHashes().digest(folder)
    (folder / "sub" / "w.bin").write_bytes(b"yy")
    assert FileHashes().digest(folder) != before, "a directory's digest covers its files' bytes"


def _old_teacher_fingerprint(teacher) -> str:
    """The teacher fingerprint as the release before this key wrote it (every weights byte hashed)."""
    import hashlib

    h = hashlib.sha256(repr(sorted(teacher.describe().items())).encode())
    h.update(Path(teacher.weights).read_bytes())
    return h.hexdigest()[:16]


def test_a_dataset_keyed_the_old_way_is_kept_unless_code_is_unknown(tmp_path, zoo_path, user, capsys):
    from train.distill import DistillJob, DomainSpec, distill
    from train.distill_spec import VERSION, fingerprint
    from train.teachers import LabelsTeacher, TeacherSettings

    folder = tmp_path / "labelled"
    for label, grey in (("dark", 10), ("light", 250)):
        (folder / label).mkdir(parents=True)
        for i in range(3):
            cv2.imwrite(str(folder / label / f"{i}.png"), np.full((24, 32, 3), grey, np.uint8))
    teacher = LabelsTeacher("labels", detail="labels of the data source")
    teacher.weights = str(user / "people.ckpt")  # a teacher with a checkpoint but no code of the user's
    spec = DomainSpec(name="shade", task="classify", target="class", teacher="labels", question="Dark or light?",
                      source={"kind": "image_folder", "path": str(folder)})
    job = DistillJob(datasets_dir=str(tmp_path / "datasets"), world_dir=str(tmp_path / "world"),
                     model="qwen2_vl_tiny", model_path=str(zoo_path), progress=False)
    settings = TeacherSettings(dir=str(tmp_path / "teachers"))
    assert distill([spec], settings, job, teachers={"labels": teacher})["shade"].status == "built"
    file = tmp_path / "datasets" / "shade" / "domain.json"
    meta = json.loads(file.read_text())
    from train.distill_prompts import PromptRenderer
    from train.distill_sources import ImageSource

    prompts = PromptRenderer(job)
    old_fp = fingerprint(VERSION, spec.to_dict(), _old_teacher_fingerprint(teacher), prompts.model, prompts.template,
                         ImageSource(spec.source_spec(), "shade").fingerprint())
    file.write_text(json.dumps({k: v for k, v in meta.items() if k != "key"} | {"fingerprint": old_fp}))
    assert distill([spec], settings, job, teachers={"labels": teacher})["shade"].status == "kept"
    assert json.loads(file.read_text())["key"] == meta["key"], "the kept dataset now records its key"

    home = tmp_path / "home"  # a plug-in's dataset from before: whether its code changed is unknown
    assert _run(home, zoo_path, _domain(user), capsys)[0] == "built"
    plugin_file = home / "datasets" / "people" / "domain.json"
    plugin_meta = json.loads(plugin_file.read_text())
    plugin_file.write_text(json.dumps({k: v for k, v in plugin_meta.items() if k != "key"} | {"fingerprint": "0" * 16}))
    status, _, log = _run(home, zoo_path, _domain(user), capsys)
    assert status == "built" and "made before its key covered the teacher's code" in log and "my_models/people.py" in log
