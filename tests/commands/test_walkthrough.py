"""The README's "bring your own camera and model" walkthrough, command by command, as a user runs it:
a teacher class of the user's own (written here, not one of ours) and a recording the user made
(a 10 fps video written here with OpenCV), distilled by configuration only, one adapter trained on
the user's checkpoint directory, served with the base model its adapter records (no model.path),
and the recording streamed through the video app with the user's teacher as its shadow.

The commands are the README's, run as `python -m vlora ...` subprocesses in the user's folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
FPS, W, H, SECONDS = 10, 96, 72, 8
PEOPLE = [1, 2, 2, 1, 3, 2, 1, 2]  # bright figures in the recording, per second

TEACHER = '''\
"""My people counter: bright blobs of at least min_area pixels (an OpenCV model of my own)."""
import cv2
import numpy as np


class PeopleCounter:
    classes = ("person",)

    def __init__(self, threshold: int = 128, min_area: int = 12):
        self.threshold, self.min_area = threshold, min_area

    def count(self, frame: np.ndarray) -> int:
        grey = cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY)
        n, _, stats, _ = cv2.connectedComponentsWithStats((grey > self.threshold).astype(np.uint8))
        return int((stats[1:, cv2.CC_STAT_AREA] >= self.min_area).sum())
'''


def _record(path: Path) -> None:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), FPS, (W, H))
    for i in range(SECONDS * FPS):
        img = np.full((H, W, 3), 30, np.uint8)
        for p in range(PEOPLE[i // FPS]):
            x, y = 4 + (i % FPS) * 2 + 28 * p, 10 + 18 * p
            cv2.rectangle(img, (x, y), (x + 5, y + 11), (250, 250, 250), -1)
        writer.write(img)
    writer.release()


def _vlora(user: Path, *args: str) -> str:
    env = {**os.environ, "VLORA_HOME": str(user / ".vlora"), "VLORA_TOKEN": "my-own-token-123",
           "PYTHONPATH": os.pathsep.join([str(user / "my_models"), str(ROOT)]), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "vlora", *args], cwd=user, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, f"vlora {args[0]} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


def test_bring_your_own_camera_teacher_and_checkpoint(tiny_zoo, tmp_path):
    user = tmp_path / "me"
    (user / "my_models").mkdir(parents=True)
    (user / "my_models" / "people.py").write_text(TEACHER)
    _record(user / "door.mp4")
    checkpoint = tiny_zoo["qwen2_vl_tiny"]  # "my checkpoint": any Qwen2-VL directory

    teacher = "{_target_: people.PeopleCounter, threshold: 128}"
    source = "{kind: video, path: door.mp4, sample_fps: 2, chunk_seconds: 1, frames_per_chunk: 2, width: 48, height: 48}"
    # 1. distil: my teacher over my recording -> a dataset of 1 s chunks, split by time
    _vlora(user, "distill", f"model.path={checkpoint}",
           f"+distill.domains.people={{name: people, task: count, target: count, "
           f"question: 'How many people are there?', teacher: {teacher}, source: {source}}}",
           "distill.only=[people]")
    domain = json.loads((user / ".vlora/datasets/people/domain.json").read_text())
    assert domain["source"]["kind"] == "video" and domain["source"]["fps"] == FPS
    assert domain["split"]["kind"] == "time" and sum(domain["sizes"].values()) == SECONDS

    # 2. train: one adapter with a count head on my checkpoint
    # (the stand-in checkpoint has the zoo's random weights, which train refuses unless forced)
    _vlora(user, "train", f"model.path={checkpoint}", "train.base=model", "train.allow_random_base=true",
           "train.dataset_dir=.vlora/datasets/people",
           "train.out_dir=.vlora/adapters/people", "train.epochs=1", "train.batch_size=4", "adapter.rank=4")
    meta = json.loads((user / ".vlora/adapters/people/meta.json").read_text())
    assert meta["base_model"]["path"] == str(Path(checkpoint).resolve()) and meta["base_model"]["fingerprint"]
    assert meta["domains"]["people"]["question"] == "How many people are there?"  # the stream asks it: routed

    # 3. serve + stream: the app's own server takes the base from the adapter (no model.path), and
    # my teacher shadows every chunk of my recording
    stream = ("[{name: door, source: door.mp4, sample_fps: 2, chunk_seconds: 1, width: 48, height: 48, "
              "backpressure: block, tasks: [{task: count, classes: [person], prompt: 'How many people are there?', "
              "accuracy_target: 0.0, latency_ms: 60000}], "
              f"shadow: {{teacher: {teacher}, share: 1.0}}}}]")
    log = _vlora(user, "video_analytics", "manifest=.vlora/adapters/people", f"streams={stream}", "duration_s=null",
                 "engine.device=cpu", "engine.policy=fcfs", "+engine.num_kv_blocks=64")
    assert f"fingerprint {meta['base_model']['fingerprint'][:19]}" in log and "recorded by the adapters" in log
    report = json.loads((user / ".vlora/results/video_analytics/latest/report.json").read_text())  # the newest run
    door = report["streams"]["door"]
    assert door["routes"]["count"]["adapter"] == "people" and door["chunks_processed"] == SECONDS
    assert door["routes"]["count"]["media"] == "clip"  # trained on the app's chunks: sent whole chunks
    shadow = door["tasks"]["count"]["shadow"]
    assert shadow["compared"] == SECONDS and 0.0 <= shadow["agreement"] <= 1.0
    assert "agree" in log  # the printed report shows the shadow's agreement
