"""The distiller: datasets on disk per the contract, from every teacher kind; resume; bad configs."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import cv2
import pytest
import torch
from datasets import load_from_disk

from train.distill import DistillJob, DomainError, DomainSpec, distill, load_distilled
from train.distill_io import features
from train.teachers import (ClassifierSpec, LabelsTeacher, TeacherSettings, TorchTeacher, YoloTeacher,
                            fit_sklearn_teacher, frame_tensor, tiny_cnn)
from train.teachers.opencv import MotionDirection
from train.teachers.yolo_world import save_untrained_yolo

CONTRACT_KEYS = {"name", "task", "labels", "max_count", "max_boxes", "teacher", "model", "media", "sizes",
                 "created_by", "version"}


@pytest.fixture(scope="module")
def zoo_path(vlora_home):
    from zoo import build_checkpoint

    return build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")  # as the tiny_zoo fixture does


def _job(tmp_path: Path, zoo_path: Path) -> DistillJob:
    return DistillJob(datasets_dir=str(tmp_path / "datasets"), world_dir=str(tmp_path / "world"),
                      model="qwen2_vl_tiny", model_path=str(zoo_path), progress=False)


def _spec(name, task, target, teacher, size=6, **kw) -> DomainSpec:
    question = None if target == "qa" else f"question of {name}?"
    return DomainSpec(name=name, task=task, target=target, teacher=teacher, question=question, size=size, **kw)


def _check_contract(path: Path, spec: DomainSpec, kind: str) -> None:
    dd, meta = load_distilled(path)
    assert set(dd) == {"train", "eval"}
    assert CONTRACT_KEYS <= set(meta) and meta["created_by"] == "vlora.distill" and meta["version"] == 1
    assert meta["task"] == spec.task and meta["media"] == spec.media and meta["model"] == "qwen2_vl_tiny"
    assert meta["teacher"]["kind"] == kind and meta["teacher"]["name"] == spec.teacher and meta["teacher"]["detail"]
    assert meta["sizes"] == {"train": dd["train"].num_rows, "eval": dd["eval"].num_rows}
    train_ids, eval_ids = set(dd["train"]["id"]), set(dd["eval"]["id"])
    assert not train_ids & eval_ids and len(train_ids | eval_ids) == spec.size and eval_ids
    placeholder = "<|video_pad|>" if spec.media == "clip" else "<|image_pad|>"
    for split in dd.values():
        assert split.features == features(), "same columns and types for every task, so domains concatenate"
        for row in split:
            assert row["domain"] == spec.name and row["task"] == spec.task and row["teacher"] == spec.teacher
            assert placeholder in row["prompt"] and row["question"] in row["prompt"]
            assert row["prompt"].rstrip().endswith("assistant")
            if spec.media == "image":
                assert row["image"].size == (224, 224) and row["image"].mode == "RGB"
                assert row["video"] == "" and row["frames"] == []
            else:
                assert row["image"] is None and Path(row["video"]).is_absolute()
                cap = cv2.VideoCapture(row["video"])
                assert int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) > max(row["frames"])
                cap.release()
                assert len(row["frames"]) == spec.frames_per_clip
            assert (row["count"] >= 0) == (spec.task == "count")
            assert (row["boxes"] != []) <= (spec.task == "detect")
            if spec.task == "count":
                assert row["label"] == row["answer"] == str(row["count"]) and row["count"] <= meta["max_count"]
            elif spec.task == "detect":
                assert row["label"] == "" and len(row["boxes"]) <= meta["max_boxes"]
                assert all(0 <= v <= 1 for b in row["boxes"] for v in b)
                assert row["answer"] == "none" if not row["boxes"] else row["answer"].count(" at (") == len(row["boxes"])
            elif spec.task in ("classify", "binary"):
                assert row["label"] in meta["labels"] and row["answer"] == row["label"]
            else:
                assert row["answer"] == row["label"] != ""


def test_distill_writes_the_contract_from_every_teacher_kind(tmp_path, zoo_path):
    cls = ("car", "bus", "truck", "person", "bicycle")
    yolo = YoloTeacher(save_untrained_yolo(tmp_path / "untrained.pt", cls), name="yolo_tiny", imgsz=96)
    sk = fit_sklearn_teacher(ClassifierSpec(target="color", images=24, val_images=8), tmp_path / "sk", "sk_color")
    torch.manual_seed(0)
    cnn = TorchTeacher(tiny_cnn(len(cls)), frame_tensor, cls, target="class", name="cnn_class")
    specs_kinds = [
        (_spec("count_v", "count", "count", "yolo_tiny", classes=["car", "bus", "truck"]), "yolo"),
        (_spec("boxes_red", "detect", "boxes", "opencv_color", max_boxes=3), "opencv"),
        (_spec("moves", "classify", "direction", "opencv_motion", media="clip", frames_per_clip=3,
               world={"clip_frames": 8}), "opencv"),
        (_spec("colour", "classify", "color", "sk_color", world={"min_objects": 1}), "sklearn"),
        (_spec("kind", "classify", "class", "cnn_class", world={"min_objects": 1}), "torch"),
        (_spec("bus", "binary", "exists", "truth", classes=["bus"]), "labels"),
        (_spec("qa", "lm", "qa", "truth"), "labels"),
    ]
    job = _job(tmp_path, zoo_path)
    results = distill([s for s, _ in specs_kinds], TeacherSettings(dir=str(tmp_path / "teachers")), job,
                      teachers={"yolo_tiny": yolo, "sk_color": sk, "cnn_class": cnn})
    assert {r.status for r in results.values()} == {"built"}
    for spec, kind in specs_kinds:
        _check_contract(Path(job.datasets_dir) / spec.name, spec, kind)
    truth_meta = json.loads((Path(job.datasets_dir) / "bus" / "domain.json").read_text())
    assert truth_meta["teacher_vs_truth"]["value"] == 1.0, "the labels teacher is the truth"
    red = load_from_disk(str(Path(job.datasets_dir) / "boxes_red"))
    assert any(r["boxes"] for r in red["train"]) or any(r["boxes"] for r in red["eval"])


class _Interrupting(LabelsTeacher):
    """The truth, but the run is killed after `limit` answers (the cache keeps what was done)."""

    def __init__(self, limit=None):
        super().__init__()
        self.calls, self.limit = 0, limit

    def answer(self, sample, query, detections=None):
        if self.limit is not None and self.calls >= self.limit:
            raise KeyboardInterrupt
        self.calls += 1
        return super().answer(sample, query, detections)


def test_distill_resumes_from_cached_answers_and_keeps_finished_domains(tmp_path, zoo_path):
    spec = _spec("count_all", "count", "count", "truth", size=10)
    settings, job = TeacherSettings(dir=str(tmp_path / "teachers")), _job(tmp_path, zoo_path)
    with pytest.raises(KeyboardInterrupt):
        distill([spec], settings, job, teachers={"truth": _Interrupting(limit=4)})
    assert not (Path(job.datasets_dir) / "count_all").exists()
    resumed = _Interrupting()
    distill([spec], settings, job, teachers={"truth": resumed})
    assert resumed.calls == 10 - 4, "the 4 answers given before the interruption are reused"

    fresh_job = _job(tmp_path / "fresh", zoo_path)
    distill([spec], settings, fresh_job, teachers={"truth": LabelsTeacher()})
    a, b = load_distilled(Path(job.datasets_dir) / "count_all")[0], load_distilled(Path(fresh_job.datasets_dir) / "count_all")[0]
    for split in ("train", "eval"):
        assert a[split]["id"] == b[split]["id"] and a[split]["count"] == b[split]["count"]

    again = _Interrupting()
    result = distill([spec], settings, job, teachers={"truth": again})["count_all"]
    assert result.status == "kept" and again.calls == 0
    changed = _spec("count_all", "count", "count", "truth", size=10, classes=["car"])
    assert distill([changed], settings, job, teachers={"truth": again})["count_all"].status == "built"


class _ThreadsSeen(MotionDirection):
    """The OpenCV motion teacher, noting which threads call it."""

    def __init__(self):
        super().__init__()
        self.threads = set()

    def direction(self, clip):
        self.threads.add(threading.get_ident())
        return super().direction(clip)


def test_label_workers_give_the_same_dataset_from_several_threads(tmp_path, zoo_path):
    spec = _spec("moves", "classify", "direction", "opencv_motion", size=40, media="clip", frames_per_clip=3,
                 world={"clip_frames": 8})
    settings = TeacherSettings(dir=str(tmp_path / "teachers"))
    serial, threaded = _ThreadsSeen(), _ThreadsSeen()
    distill([spec], settings, _job(tmp_path / "one", zoo_path), teachers={"opencv_motion": serial})
    job = replace(_job(tmp_path / "four", zoo_path), label_workers=4)
    distill([spec], settings, job, teachers={"opencv_motion": threaded})
    assert len(serial.threads) == 1 and len(threaded.threads) > 1
    a = load_distilled(tmp_path / "one" / "datasets" / "moves")[0]
    b = load_distilled(Path(job.datasets_dir) / "moves")[0]
    for split in ("train", "eval"):
        assert a[split]["id"] == b[split]["id"] and a[split]["label"] == b[split]["label"]
    assert len(set(a["train"]["label"]) | set(a["eval"]["label"])) > 1, "a test on one label would not see a mix-up"
    with pytest.raises(DomainError, match=r"distill.label_workers=0: must be an int >= 1"):
        replace(job, label_workers=0)


def test_bad_domain_configs_fail_early_and_name_the_fix(tmp_path, zoo_path):
    settings, job = TeacherSettings(dir=str(tmp_path / "teachers")), _job(tmp_path, zoo_path)
    with pytest.raises(DomainError, match=r"task 'count' does not match target 'color'.*'classify' task"):
        _spec("x", "count", "color", "truth")
    with pytest.raises(DomainError, match="needs media: clip"):
        _spec("x", "classify", "direction", "truth")
    with pytest.raises(DomainError, match=r"classes must be a non-empty list from the world's classes"):
        _spec("x", "count", "count", "truth", classes=["tram"])
    with pytest.raises(DomainError, match=r"unknown fields \['teachr'\]"):
        DomainSpec.from_dict({"name": "x", "task": "count", "target": "count", "teachr": "truth"})
    with pytest.raises(DomainError, match="question is required"):
        DomainSpec(name="x", task="count", target="count", teacher="truth")
    with pytest.raises(ValueError, match=r"unknown teacher 'yolo9'.*valid teachers"):
        distill([_spec("x", "count", "count", "yolo9")], settings, job)
    # a teacher that cannot answer the target is refused before anything is trained or rendered
    with pytest.raises(DomainError, match=r"teacher 'yolo_world' cannot answer target 'direction'"):
        distill([_spec("x", "classify", "direction", "yolo_world", media="clip")], settings, job)
    with pytest.raises(DomainError, match=r"teacher 'opencv_motion' \(opencv\) cannot answer target 'count'"):
        distill([_spec("x", "count", "count", "truth")], settings, job, teachers={"truth": _motion()})
    assert not (tmp_path / "teachers").exists() and not (tmp_path / "world").exists()


def _motion():
    from train.teachers import MotionDirection

    return MotionDirection()


def _compose(name: str, overrides=()):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from vlora.config import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name=name):
        return compose(config_name=name, overrides=list(overrides))


def test_default_domain_configs_compose_and_cover_the_tasks(vlora_home):
    from train.teachers import BUILTIN, teacher_targets
    from vlora.commands.distill import domain_specs
    from vlora.commands.teachers import teacher_settings

    cfg = _compose("distill")
    specs, settings = domain_specs(cfg), teacher_settings(cfg)
    assert len(specs) >= 6 and len({s.task for s in specs}) >= 3
    assert len({BUILTIN[s.teacher] for s in specs}) >= 4, "several teacher kinds"
    for s in specs:
        assert s.target in teacher_targets(s.teacher, settings)
    assert settings.dir == f"{vlora_home}/teachers"
    assert [s.name for s in domain_specs(_compose("distill", ["distill.only=[qa,direction]"]))] == ["direction", "qa"]
    with pytest.raises(DomainError, match=r"distill.only names unknown domains \['nope'\]"):
        domain_specs(_compose("distill", ["distill.only=[nope]"]))


def test_commands_run_on_shrunk_defaults(tmp_path, zoo_path, capsys):
    from vlora.commands import distill as distill_cmd
    from vlora.commands import teachers as teachers_cmd

    home = [f"paths.home={tmp_path}"]
    rows = teachers_cmd.run(_compose("teachers", home + ["build=[sklearn_color]", "teachers.sklearn_color.images=24",
                                                         "teachers.sklearn_color.val_images=8"]))
    assert rows[0]["teacher"] == "sklearn_color" and rows[0]["kind"] == "sklearn"
    assert (tmp_path / "teachers" / "sklearn_color" / "model.joblib").is_file()
    assert json.loads((tmp_path / "teachers" / "report.json").read_text()) == rows
    cfg = _compose("distill", home + [f"model.path={zoo_path}", "distill.only=[exists_bus,qa]",
                                      "distill.domains.exists_bus.size=6", "distill.domains.qa.size=6"])
    results = distill_cmd.run(cfg)
    assert list(results) == ["exists_bus", "qa"]
    assert (tmp_path / "datasets" / "qa" / "domain.json").is_file()
    assert "teacher_vs_truth" in capsys.readouterr().out
    assert {r.status for r in distill_cmd.run(cfg).values()} == {"kept"}
