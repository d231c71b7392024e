"""A user's own teacher and data through configuration only: `_target_` plug-ins and a plain
callable, a recording cut into the video app's chunks with a time-based split, unlabelled images,
and labelled data (image folder per class, COCO, YOLO) read as truth. Every domain is given as
Hydra overrides of the real `distill` config and distilled by the command's run()."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
from datasets import load_from_disk

from train.distill import DomainError

HERE = Path(__file__).resolve().parent
FPS, W, H, SECONDS = 10, 64, 48, 6
COUNTS = [1, 2, 1, 3, 2, 1]  # bright rectangles in the recording, per second


# ----------------------------------------------------------------------------- the user's teachers
class BrightBlobCounter:
    """A user's OpenCV model: counts bright blobs (not one of ours; only `count` is implemented)."""

    classes = ("blob",)

    def __init__(self, threshold: int = 128, min_area: int = 6):
        self.threshold, self.min_area = threshold, min_area

    def count(self, frame: np.ndarray) -> int:
        grey = cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY)
        n, _, stats, _ = cv2.connectedComponentsWithStats((grey > self.threshold).astype(np.uint8))
        return int((stats[1:, cv2.CC_STAT_AREA] >= self.min_area).sum())


def is_bright(frame: np.ndarray) -> bool:
    """A plain callable teacher: the answer's type (here yes/no) comes from the domain's target."""
    return bool(frame.mean() > 100)


# ----------------------------------------------------------------------------- data the test writes
def _frame(n_rects: int, shift: int) -> np.ndarray:
    img = np.full((H, W, 3), 20, np.uint8)
    for r in range(n_rects):
        x, y = 2 + shift + 20 * r, 6 + 12 * r
        cv2.rectangle(img, (x, y), (x + 7, y + 5), (255, 255, 255), -1)
    return img


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "cam.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), FPS, (W, H))
    for i in range(SECONDS * FPS):
        writer.write(_frame(COUNTS[i // FPS], i % FPS))
    writer.release()
    return path


@pytest.fixture(scope="module")
def zoo_path(vlora_home):
    from zoo import build_checkpoint

    return build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")


@pytest.fixture(autouse=True)
def _teacher_module_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # as a user puts their teacher's directory on PYTHONPATH


def _run(home: Path, zoo: Path, domain: str, name: str, extra=()):
    from vlora.commands import distill as distill_cmd
    from vlora.config import compose

    cfg = compose("distill", [f"paths.home={home}", f"model.path={zoo}", f"+distill.domains.{name}={domain}",
                              f"distill.only=[{name}]", *extra])
    return distill_cmd.run(cfg)[name]


def _rows(path: Path) -> tuple[list[dict], list[dict], dict]:
    dd = load_from_disk(str(path))
    return list(dd["train"]), list(dd["eval"]), json.loads((path / "domain.json").read_text())


# ----------------------------------------------------------------------------- tests
def test_user_teacher_on_a_recording_from_config(tmp_path, zoo_path, recording):
    teacher = "{_target_: test_distill_sources.BrightBlobCounter, threshold: 128}"
    domain = (f"{{name: blobs, task: count, target: count, question: 'How many bright blobs are there?', "
              f"teacher: {teacher}, eval_fraction: 0.34, source: {{kind: video, path: '{recording}', "
              f"sample_fps: 2, chunk_seconds: 1, frames_per_chunk: 2, width: 32, height: 24}}}}")
    result = _run(tmp_path, zoo_path, domain, "blobs")
    assert result.status == "built"
    train, evals, meta = _rows(tmp_path / "datasets" / "blobs")
    # 6 s at 10 fps sampled at 2 fps: 12 frames, chunks of 2 -> one chunk per second
    assert [r["id"] for r in train + evals] == [f"chunk-{i:06d}" for i in range(SECONDS)]
    assert [r["count"] for r in train + evals] == COUNTS, "the teacher counted each chunk's middle frame"
    assert len(evals) == 2 and max(r["id"] for r in train) < min(r["id"] for r in evals), \
        "eval is the final stretch of the recording: no eval chunk between train chunks"
    from train.data import Encoder

    for row in train + evals:
        assert row["media"] == "clip" and row["image"] is None and row["frames"] == [0, 1]
        assert "<|video_pad|>" in row["prompt"] and row["teacher"] == "test_distill_sources.BrightBlobCounter"
        frames = Encoder._media(SimpleNamespace(arch="qwen2_vl", frames_default=4), row)  # what training reads
        assert len(frames) == 2 and frames[0].shape == (24, 32, 3), "chunks at the app's size"
    src = meta["source"]
    assert src["kind"] == "video" and src["path"] == str(recording.resolve())
    assert src["fps"] == FPS and src["fps_from_file"] and src["frame_count"] == SECONDS * FPS
    assert src["sampled_fps"] == 2 and src["chunk_frames"] == 2 and src["chunks"] == SECONDS
    assert src["chunk_size"] == [32, 24] and "world" not in meta
    assert meta["split"]["kind"] == "time" and meta["split"]["eval_from_s"] == 4.0
    assert meta["teacher"]["kind"] == "plugin" and meta["max_count"] == 3 and meta["media"] == "clip"

    from train import LoraSpec, ModelRef, TrainConfig, VisionLM, load_domain, train_adapter

    vlm = VisionLM(ModelRef("qwen2_vl_tiny", str(zoo_path)), LoraSpec(rank=4, alpha=8), device="cpu")
    trained = train_adapter(vlm, load_domain(tmp_path / "datasets" / "blobs"), TrainConfig(epochs=1))
    assert trained.steps == 1 and trained.metrics["n"] == 2, "training reads the chunks as video"

    assert _run(tmp_path, zoo_path, domain, "blobs").status == "kept", "a second run keeps it"
    changed = domain.replace("threshold: 128", "threshold: 129")
    assert _run(tmp_path, zoo_path, changed, "blobs").status == "built", "the plug-in's arguments count"


def test_plain_callable_teacher_on_unlabelled_images(tmp_path, zoo_path):
    folder = tmp_path / "shots"
    folder.mkdir()
    for i in range(6):
        cv2.imwrite(str(folder / f"{i}.png"), np.full((24, 32, 3), 200 if i % 2 else 10, np.uint8))
    domain = (f"{{name: bright, task: binary, target: exists, question: 'Is it bright?', "
              f"teacher: {{_target_: test_distill_sources.is_bright}}, source: {{kind: images, path: '{folder}'}}}}")
    assert _run(tmp_path, zoo_path, domain, "bright").status == "built"
    train, evals, meta = _rows(tmp_path / "datasets" / "bright")
    by_id = {r["id"]: r["label"] for r in train + evals}
    assert by_id == {f"image-{i:06d}": "yes" if i % 2 else "no" for i in range(6)}
    assert meta["source"]["kind"] == "images" and meta["split"]["kind"] == "random" and meta["labels"] == ["no", "yes"]
    assert all(r["image"].size == (32, 24) for r in train + evals)


@pytest.mark.parametrize("asked, match", [
    ("target: exists, teacher: {_target_: test_distill_sources.NoSuchTeacher}", r"has no attribute 'NoSuchTeacher'"),
    ("target: exists, teacher: {_target_: no_such_package.Teacher}",
     r"cannot import module 'no_such_package'.*PYTHONPATH"),
    ("target: exists, teacher: {_target_: test_distill_sources.BrightBlobCounter}",
     r"cannot answer target 'exists'; it answers \['count'\]"),
    ("target: count, classes: [person], teacher: {_target_: test_distill_sources.BrightBlobCounter}",
     r"does not know classes \['person'\]; its classes: \['blob'\]"),
    ("target: count, teacher: labels", r"teacher 'labels' reads labels, but a 'video' source has none"),
])
def test_bad_plugin_teachers_fail_before_any_work(tmp_path, recording, asked, match):
    task = "binary" if "exists" in asked else "count"
    domain = (f"{{name: bad, task: {task}, {asked}, question: 'Any?', "
              f"source: {{kind: video, path: '{recording}', sample_fps: 2}}}}")
    with pytest.raises(DomainError, match=match):
        _run(tmp_path, tmp_path / "no_model", domain, "bad")
    assert not (tmp_path / "world").exists() and not (tmp_path / "datasets").exists()


def test_labelled_image_folder_is_read_as_truth(tmp_path, zoo_path):
    for label, value in (("bright", 220), ("dark", 15)):
        (tmp_path / "data" / label).mkdir(parents=True)
        for i in range(3):
            cv2.imwrite(str(tmp_path / "data" / label / f"{i}.jpg"), np.full((16, 16, 3), value + i, np.uint8))
    domain = (f"{{name: light, task: classify, target: class, question: 'Bright or dark?', teacher: labels, "
              f"source: {{kind: image_folder, path: '{tmp_path / 'data'}'}}}}")
    assert _run(tmp_path, zoo_path, domain, "light").status == "built"
    train, evals, meta = _rows(tmp_path / "datasets" / "light")
    assert meta["labels"] == ["bright", "dark"] and meta["source"]["labels"] == ["bright", "dark"]
    assert sorted(r["label"] for r in train + evals) == ["bright"] * 3 + ["dark"] * 3
    assert meta["teacher_vs_truth"]["value"] == 1.0 and meta["teacher"]["kind"] == "labels"


def test_coco_and_yolo_boxes_are_read_as_truth(tmp_path, zoo_path):
    images = tmp_path / "yolo" / "images"
    (tmp_path / "yolo" / "labels").mkdir(parents=True)
    images.mkdir(parents=True)
    coco = {"images": [], "annotations": [], "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}]}
    for i in range(4):
        cv2.imwrite(str(images / f"{i}.png"), np.zeros((20, 40, 3), np.uint8))
        coco["images"].append({"id": i, "file_name": f"{i}.png", "width": 40, "height": 20})
        lines = []
        for k in range(i):  # image i shows i objects, each 10 x 10 px
            coco["annotations"].append({"image_id": i, "category_id": 1 + k % 2, "bbox": [10 * k, 5, 10, 10]})
            lines.append(f"{k % 2} {(10 * k + 5) / 40} {10 / 20} {10 / 40} {10 / 20}")
        (tmp_path / "yolo" / "labels" / f"{i}.txt").write_text("\n".join(lines))
    (tmp_path / "coco.json").write_text(json.dumps(coco))

    domain = (f"{{name: cats, task: detect, target: boxes, question: 'Where are the cats?', teacher: labels, "
              f"classes: [cat], source: {{kind: coco, path: '{tmp_path / 'coco.json'}', images: '{images}'}}}}")
    assert _run(tmp_path, zoo_path, domain, "cats").status == "built"
    train, evals, meta = _rows(tmp_path / "datasets" / "cats")
    boxes = {r["id"]: r["boxes"] for r in train + evals}
    assert boxes["image-000003"] == [pytest.approx([0.0, 0.25, 0.25, 0.75]), pytest.approx([0.5, 0.25, 0.75, 0.75])]
    assert meta["source"]["classes"] == ["cat", "dog"] and meta["max_boxes"] == 2

    domain = (f"{{name: pets, task: count, target: count, question: 'How many pets?', teacher: labels, "
              f"source: {{kind: yolo, path: '{tmp_path / 'yolo'}', names: [cat, dog]}}}}")
    assert _run(tmp_path, zoo_path, domain, "pets").status == "built"
    train, evals, meta = _rows(tmp_path / "datasets" / "pets")
    assert {r["id"]: r["count"] for r in train + evals} == {f"image-{i:06d}": i for i in range(4)}
    bad = domain.replace("classes", "x").replace("teacher: labels,", "teacher: labels, classes: [horse],")
    with pytest.raises(DomainError, match=r"classes \['horse'\] are not all in the labelled data's classes"):
        _run(tmp_path, zoo_path, bad.replace("name: pets", "name: horses"), "horses")


def test_saved_hugging_face_dataset_is_read_as_truth(tmp_path, zoo_path):
    from datasets import ClassLabel, Dataset, Features, Image

    from PIL import Image as PILImage

    images = [PILImage.fromarray(np.full((12, 12, 3), 30 * i, np.uint8)) for i in range(4)]
    feats = Features({"picture": Image(), "kind": ClassLabel(names=["cat", "dog"])})
    Dataset.from_dict({"picture": images, "kind": [0, 1, 1, 0]}, features=feats).save_to_disk(str(tmp_path / "hf"))
    domain = (f"{{name: pets, task: classify, target: class, question: 'Cat or dog?', teacher: labels, "
              f"source: {{kind: hf, path: '{tmp_path / 'hf'}', image_column: picture, label_column: kind}}}}")
    assert _run(tmp_path, zoo_path, domain, "pets").status == "built"
    train, evals, meta = _rows(tmp_path / "datasets" / "pets")
    assert {r["id"]: r["label"] for r in train + evals} == {
        "image-000000": "cat", "image-000001": "dog", "image-000002": "dog", "image-000003": "cat"}
    assert meta["labels"] == ["cat", "dog"] and meta["source"]["kind"] == "hf"
