"""Mirrored and reversed training copies: real clip files and pictures, labels mapped, eval untouched."""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from train.distill import DistillJob, DomainError, DomainSpec, distill, load_distilled
from train.distill_augment import combinations, transform_answer
from train.teachers import Answer, Detection, LabelsTeacher, TeacherSettings
from world import read_video


@pytest.fixture(scope="module")
def zoo_path(vlora_home):
    from zoo import build_checkpoint

    return build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")


def _job(tmp_path: Path, zoo_path: Path) -> DistillJob:
    return DistillJob(datasets_dir=str(tmp_path / "datasets"), world_dir=str(tmp_path / "world"),
                      model="qwen2_vl_tiny", model_path=str(zoo_path), progress=False)


def _distill(tmp_path, zoo_path, spec, teacher=None):
    teachers = {"truth": LabelsTeacher()} if teacher is None else {spec.teacher: teacher}
    distill([spec], TeacherSettings(dir=str(tmp_path / "teachers")), _job(tmp_path, zoo_path), teachers=teachers)
    return load_distilled(tmp_path / "datasets" / spec.name)


def test_answers_follow_the_transform():
    go = Answer(label="left")
    assert transform_answer(go, ("hflip",), "direction", 100, 50).label == "right"
    assert transform_answer(go, ("vflip",), "direction", 100, 50).label == "left"
    assert transform_answer(Answer(label="up"), ("reverse",), "direction", 100, 50).label == "down"
    assert transform_answer(Answer(label="up"), ("vflip", "reverse"), "direction", 100, 50).label == "up"
    assert transform_answer(Answer(label="stationary"), ("hflip", "reverse"), "direction", 100, 50).label == "stationary"
    assert transform_answer(Answer(label="red"), ("hflip",), "color", 100, 50).label == "red", "colour does not mirror"
    boxes = Answer(boxes=(Detection("car", 0.9, (10.0, 5.0, 30.0, 20.0)),))
    assert transform_answer(boxes, ("hflip",), "boxes", 100, 50).boxes[0].box == (70.0, 5.0, 90.0, 20.0)
    assert transform_answer(boxes, ("vflip",), "boxes", 100, 50).boxes[0].box == (10.0, 30.0, 30.0, 45.0)
    assert combinations(["hflip", "reverse"]) == [("hflip",), ("reverse",), ("hflip", "reverse")]


def test_bad_augment_is_refused_when_the_domain_is_read():
    def spec(**kw):
        return DomainSpec(name="d", task="classify", target="direction", teacher="opencv_motion", media="clip",
                          question="which way?", **kw)

    with pytest.raises(DomainError, match=r"augment \['rotate'\] unknown; transforms are"):
        spec(augment=["rotate"])
    with pytest.raises(DomainError, match="augment must be a list"):
        spec(augment="hflip")
    with pytest.raises(DomainError, match="'reverse' needs media: clip"):
        DomainSpec(name="c", task="count", target="count", teacher="truth", question="how many?", augment=["reverse"])
    with pytest.raises(DomainError, match="does not apply to target 'qa'"):
        DomainSpec(name="q", task="lm", target="qa", teacher="truth", augment=["hflip"])
    with pytest.raises(DomainError, match=r"labels \['north', 'south'\] name others"):
        spec(augment=["hflip"], labels=["north", "south"])
    assert spec(augment=["reverse", "hflip"]).augment == ["hflip", "reverse"]
    assert "augment" not in spec().to_dict(), "a domain without copies keeps the fingerprint it had"


def test_direction_clips_get_mirrored_and_reversed_copies(tmp_path, zoo_path):
    spec = DomainSpec(name="moves", task="classify", target="direction", teacher="truth", media="clip",
                      question="Which way?", size=6, frames_per_clip=3, world={"clip_frames": 8},
                      augment=["hflip", "reverse"])
    dd, meta = _distill(tmp_path, zoo_path, spec)
    originals = {r["id"]: r for r in dd["train"] if "+" not in r["id"]}
    copies = [r for r in dd["train"] if "+" in r["id"]]
    assert len(copies) == 3 * len(originals) and dd["eval"].num_rows == 6 - len(originals)
    assert not any("+" in i for i in dd["eval"]["id"]), "eval holds only what the teacher saw"
    assert meta["augment"] == {"transforms": ["hflip", "reverse"], "items": len(originals), "copies_per_item": 3}
    assert meta["sizes"]["train"] == 4 * len(originals)
    swap = {"left": "right", "right": "left", "up": "down", "down": "up", "stationary": "stationary"}
    for copy in copies:
        source_id, combo = copy["id"].split("+")[0], copy["id"].split("+")[1:]
        original = originals[source_id]
        expected = original["label"]
        for t in combo:  # hflip swaps left/right; reverse swaps both axes
            expected = {**swap, "up": "up", "down": "down"}[expected] if t == "hflip" else swap[expected]
        assert copy["label"] == copy["answer"] == expected, copy["id"]
        assert copy["frames"] == original["frames"] and copy["question"] == original["question"]
        mine, theirs = read_video(copy["video"]), read_video(original["video"])
        assert len(mine) == len(theirs) and Path(copy["video"]).is_absolute()
        want = [f[:, ::-1] for f in theirs] if "hflip" in combo else theirs
        want = want[::-1] if "reverse" in combo else want
        # the copy is re-encoded: near the transformed original, far from the untransformed one
        err = np.mean([np.abs(a.astype(int) - b.astype(int)).mean() for a, b in zip(mine, want)])
        assert err < 6.0, (copy["id"], err)
    moving = [c for c in copies if originals[c["id"].split("+")[0]]["label"] != "stationary"]
    assert moving, "the world's clips move"
    # a rerun with the same config keeps the domain and its clip files
    clips = sorted(p.name for p in (tmp_path / "world").glob("augment-moves-*/*"))
    assert len(clips) == len(copies) and not any(n.startswith(".") for n in clips)
    _distill(tmp_path, zoo_path, spec)
    assert sorted(p.name for p in (tmp_path / "world").glob("augment-moves-*/*")) == clips


def test_pictures_and_boxes_are_mirrored(tmp_path, zoo_path):
    spec = DomainSpec(name="cars", task="detect", target="boxes", teacher="truth", classes=["car"],
                      question="Where are the cars?", size=8, world={"min_objects": 2}, augment=["hflip", "vflip"])
    dd, meta = _distill(tmp_path, zoo_path, spec)
    rows = {r["id"]: r for r in dd["train"]}
    originals = [r for i, r in rows.items() if "+" not in i]
    assert len(rows) == 4 * len(originals) and any(r["boxes"] for r in originals)
    for r in originals:
        picture = np.asarray(r["image"])
        for combo, flip in ((("hflip",), lambda a: a[:, ::-1]), (("vflip",), lambda a: a[::-1]),
                            (("hflip", "vflip"), lambda a: a[::-1, ::-1])):
            copy = rows[f"{r['id']}+{'+'.join(combo)}"]
            assert np.array_equal(np.asarray(copy["image"]), flip(picture)), "PNG copies are exact"
            want = []
            for x1, y1, x2, y2 in r["boxes"]:
                if "hflip" in combo:
                    x1, x2 = 1 - x2, 1 - x1
                if "vflip" in combo:
                    y1, y2 = 1 - y2, 1 - y1
                want.append((x1, y1, x2, y2))
            got = sorted(tuple(b) for b in copy["boxes"])
            assert np.allclose(got, sorted(want), atol=1e-5), copy["id"]
            assert copy["answer"].count(" at (") == len(copy["boxes"])
    info = json.loads((tmp_path / "datasets" / "cars" / "domain.json").read_text())
    assert info["augment"]["items"] == len(originals)


def test_fusion_orders_augmented_domains_by_the_items_the_teacher_labelled(tmp_path, zoo_path):
    from train.data import load_domain

    spec = DomainSpec(name="cnt", task="count", target="count", teacher="truth", question="How many?", size=6,
                      augment=["hflip"])
    dd, _ = _distill(tmp_path, zoo_path, spec)
    data = load_domain(tmp_path / "datasets" / "cnt")
    assert data.size("train") == 2 * data.distinct_train == dd["train"].num_rows
    copies = [r for r in dd["train"] if "+" in r["id"]]
    assert all(c["count"] == dd["train"].filter(lambda r, i=c["id"].split("+")[0]: r["id"] == i)[0]["count"]
               for c in copies), "a count does not change in the mirror"
