"""A classification domain trained on real data and served through both apps scores what training
scored, item by item.

The data are scikit-learn's bundled digits (8x8 greyscale scans of handwriting, upscaled to 56x56),
laid out as a user's labelled image folder (a sub-folder per digit). The commands are the documented
ones, run in-process on their composed configs: `vlora distill` (teacher: labels), `vlora train` (a
classify head on the tiny model), then a real `vlora serve` subprocess with the adapter, and against
it `vlora visual_retrieval` with a query file of the eval items asking the domain's question, and
`vlora video_analytics` with a lossless recording of the same items and a `classify` task whose shadow
teacher knows each picture's label. Both apps answer with the adapter's head, report the accuracy
`vlora train`'s eval recorded in meta.json, and give every item the same answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest

from rpc_server import TOKEN, ServerProcess
from vlora.config import compose

SIZE, ITEMS = 56, 32  # 56x56: the tiny model's 14-pixel patches, 2x2 merged
CLASSES = (0, 1, 7)  # three digits: a head on the random tiny model tells some apart in a few steps
QUESTION = "Which digit is this?"
FRAMES_PER_ITEM = 2  # each digit is one chunk of the recording

TEACHER = '''\
"""The digits' labels as a teacher: the label of the known picture a frame shows."""
from pathlib import Path

import cv2
import numpy as np


class DigitLabels:
    def __init__(self, folder: str):
        files = sorted(Path(folder).glob("*.png"))
        self.images = np.stack([cv2.imread(str(f))[..., ::-1].astype(np.int16) for f in files])
        self.names = [f.stem.split("_")[0] for f in files]  # <label>_<item>.png

    def classify(self, frame):
        distance = np.abs(self.images - frame.astype(np.int16)).sum(axis=(1, 2, 3))
        return self.names[int(distance.argmin())]
'''


def _digit_folder(root: Path) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    picked = [i for i in range(len(digits.target)) if digits.target[i] in CLASSES][:ITEMS]
    for i in picked:
        grey = cv2.resize((digits.images[i] * (255 / 16)).astype(np.uint8), (SIZE, SIZE),
                          interpolation=cv2.INTER_NEAREST)
        folder = root / str(digits.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(folder / f"d{i:03d}.png"), cv2.cvtColor(grey, cv2.COLOR_GRAY2BGR))


@pytest.fixture(scope="module")
def trained(tiny_zoo, tmp_path_factory):
    """(the user's folder, the adapter directory, its meta.json, the eval items as (label, RGB) pairs)."""
    from datasets import load_from_disk

    from vlora.commands import distill, train

    user = tmp_path_factory.mktemp("digits_user")
    _digit_folder(user / "digits")
    home, checkpoint = user / ".vlora", tiny_zoo["qwen2_vl_tiny"]
    distill.run(compose("distill", [f"paths.home={home}", f"model.path={checkpoint}", "distill.only=[digits]",
                                    f"+distill.domains.digits={{name: digits, task: classify, target: class, "
                                    f"question: '{QUESTION}', teacher: labels, eval_fraction: 0.25, "
                                    f"source: {{kind: image_folder, path: '{user / 'digits'}'}}}}"]))
    dataset, adapter = home / "datasets" / "digits", home / "adapters" / "digits"
    # the tiny model's weights are random, which train refuses unless told: the plumbing is what is tested
    train.run(compose("train", [f"paths.home={home}", f"model.path={checkpoint}", "train.base=model",
                                "train.allow_random_base=true", f"train.dataset_dir={dataset}",
                                f"train.out_dir={adapter}", "train.epochs=2", "train.batch_size=8",
                                "train.head_lr=0.05", "adapter.rank=4"]))
    meta = json.loads((adapter / "meta.json").read_text())
    items = [(row["label"], np.asarray(row["image"].convert("RGB"))) for row in load_from_disk(str(dataset))["eval"]]
    return user, adapter, meta, items


@pytest.fixture(scope="module")
def served(trained, tiny_zoo):
    user, adapter, _, _ = trained
    server = ServerProcess(tiny_zoo["qwen2_vl_tiny"], user / ".vlora", f"adapters.manifest={adapter}")
    try:
        yield server
    finally:
        server.stop()


def test_both_apps_serve_the_classify_head_at_trains_eval_accuracy(trained, served, tmp_path, monkeypatch):
    from vlora.commands import video_analytics, visual_retrieval

    user, adapter, meta, items = trained
    record = meta["domains"]["digits"]
    expected, n = record["accuracy"], record["n_eval"]
    assert n == len(items) == 8 and record["baseline"]["n"] == n  # what train's eval scored
    monkeypatch.setenv("VLORA_TOKEN", TOKEN)
    common = [f"paths.home={user / '.vlora'}", f"server.port={served.port}", f"manifest={adapter}"]

    # visual retrieval: the eval pictures, the domain's question, their labels; a key of the user's own
    photos = tmp_path / "photos"
    photos.mkdir()
    lines = []
    for i, (label, rgb) in enumerate(items):
        cv2.imwrite(str(photos / f"item{i:02d}.png"), rgb[..., ::-1])
        lines.append(json.dumps({"image": f"item{i:02d}.png", "question": QUESTION, "answer": label, "item": i}))
    (tmp_path / "queries.jsonl").write_text("\n".join(lines) + "\n")
    report = visual_retrieval.run(compose("visual_retrieval", common + [
        f"queries={tmp_path / 'queries.jsonl'}", f"collection={photos}", "heads=always", "draw=none",
        "run_name=digits"]))
    rows = [json.loads(line) for line in Path(report["results"]).read_text().splitlines()]
    assert report["overall"]["skipped_lines"] == 0 and report["overall"]["errors"] == 0
    assert set(report["by_kind"]) == {"classify"}  # "Which digit is this?" reads as qa; the domain asked it
    (route,) = report["routes"].values()
    assert (route["adapter"], route["output_mode"], route["head"]) == ("digits", "head", "digits")
    assert route["via"] == "question matches domain digits" and route["baselines"]["majority"] == record["baseline"]
    assert report["by_kind"]["classify"]["accuracy"] == pytest.approx(expected, abs=1e-4)
    assert [r["meta"] for r in rows] == [{"item": i} for i in range(n)]  # the user's key, carried through
    retrieval_answers = [r["prediction"]["label"] for r in rows]
    assert all(r["prediction"]["source"] == "head" for r in rows)
    # heads=never: the same adapter in text, read against the domain's labels; auto: its head
    for heads, mode in (("never", "generate"), ("auto", "head")):
        again = visual_retrieval.run(compose("visual_retrieval", common + [
            f"queries={tmp_path / 'queries.jsonl'}", f"collection={photos}", f"heads={heads}", "draw=none",
            f"run_name={heads}", "max_new_tokens=2"]))
        (route,) = again["routes"].values()
        assert (route["adapter"], route["output_mode"]) == ("digits", mode), heads

    # video analytics: the same pictures as a lossless recording, one chunk each, a classify task
    (user / "shadow").mkdir()
    (user / "shadow" / "digit_labels.py").write_text(TEACHER)
    monkeypatch.syspath_prepend(str(user / "shadow"))
    known = tmp_path / "known"
    known.mkdir()
    writer = cv2.VideoWriter(str(tmp_path / "digits.mkv"), cv2.VideoWriter_fourcc(*"FFV1"), 10, (SIZE, SIZE))
    for i, (label, rgb) in enumerate(items):
        cv2.imwrite(str(known / f"{label}_{i:02d}.png"), rgb[..., ::-1])
        for _ in range(FRAMES_PER_ITEM):
            writer.write(rgb[..., ::-1].copy())
    writer.release()
    stream = (f"[{{name: digits, source: '{tmp_path / 'digits.mkv'}', sample_fps: null, chunk_frames: {FRAMES_PER_ITEM}, "
              f"width: {SIZE}, height: {SIZE}, backpressure: block, realtime: false, annotate: null, "
              f"tasks: [{{task: classify, manifest_key: digits, accuracy_target: 0.0, latency_ms: 60000}}], "
              f"shadow: {{teacher: {{_target_: digit_labels.DigitLabels, folder: '{known}'}}, share: 1.0}}}}]")
    video = video_analytics.run(compose("video_analytics", common + [
        f"streams={stream}", "duration_s=null", "run_name=digits", "report_every_s=60"]))
    cam = video["streams"]["digits"]
    assert cam["chunks_processed"] == n and cam["routes"]["classify"]["output_mode"] == "head"
    assert cam["routes"]["classify"]["question"] == QUESTION  # asked what its items asked
    shadow = cam["tasks"]["classify"]["shadow"]
    assert shadow["compared"] == n and shadow["agreement"] == pytest.approx(expected, abs=1e-4)
    results = [json.loads(line) for line in Path(video["sink"]).read_text().splitlines()]
    video_answers = [r["prediction"]["label"] for r in sorted((r for r in results if r.get("type") == "result"),
                                                              key=lambda r: r["chunk"])]
    assert video_answers == retrieval_answers  # the same answer for every item
    assert sum(a == label for a, (label, _) in zip(video_answers, items)) == round(expected * n)
