"""Mirrored and time-reversed copies of a domain's training items, labelled without the teacher.

A small domain overfits: direction's 384 clips are learnt to a training loss of 0.01 while the
eval split stays at 0.6. The teacher's answer to a mirrored or reversed item is known from its
answer to the original, so more rows cost only writing the pictures:

    transform  pictures                 counts, presence, colour, class  direction           boxes
    hflip      mirrored left-right      the same                         left <-> right      mirrored
    vflip      mirrored top-bottom      the same                         up <-> down         mirrored
    reverse    frames in reverse order  the same                         left <-> right and  (not allowed)
               (clips only)                                              up <-> down

A domain's `augment: [hflip, reverse]` adds one copy of every training item per non-empty
combination of the listed transforms (here 3: hflip, reverse, both). Only the train split grows;
eval stays the items the teacher saw, so scores remain comparable. Free-form answers (qa) may
name sides or motions the table cannot map, so qa domains are not augmented.

Copies of images go into the dataset as PNG bytes; copies of clips are written as clip files of
their own beside the world (`<world_dir>/augment-<domain>-<fingerprint>/`), at the original's
frame rate, and a rerun with the same fingerprint reuses them.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .teachers import Answer

TRANSFORMS = ("hflip", "vflip", "reverse")
_MIRROR = {"hflip": {"left": "right", "right": "left"}, "vflip": {"up": "down", "down": "up"},
           "reverse": {"left": "right", "right": "left", "up": "down", "down": "up"}}


def check_augment(augment: Any, target: str, media: str, where: str) -> list[str]:
    """The domain's transforms, in TRANSFORMS order; a ValueError names what cannot be augmented."""
    if augment is None:
        return []
    if isinstance(augment, str) or not isinstance(augment, Sequence):
        raise ValueError(f"{where}: augment must be a list of {list(TRANSFORMS)}, got {augment!r}")
    bad = [t for t in augment if t not in TRANSFORMS]
    if bad:
        raise ValueError(f"{where}: augment {bad} unknown; transforms are {list(TRANSFORMS)}")
    if augment and target == "qa":
        raise ValueError(f"{where}: qa answers are free text that may name sides or motions; augment does not "
                         "apply to target 'qa'")
    if "reverse" in augment and media != "clip":
        raise ValueError(f"{where}: augment 'reverse' needs media: clip (a picture has no time order)")
    if "reverse" in augment and target == "boxes":
        raise ValueError(f"{where}: augment 'reverse' does not apply to target 'boxes' (a clip's boxes belong "
                         "to one of its frames)")
    return [t for t in TRANSFORMS if t in augment]


def combinations(transforms: Sequence[str]) -> list[tuple[str, ...]]:
    """Every non-empty combination of the transforms: one copy of each item per combination."""
    return [c for n in range(1, len(transforms) + 1) for c in itertools.combinations(transforms, n)]


def transform_frames(frames: list[np.ndarray], combo: Sequence[str]) -> list[np.ndarray]:
    out = list(frames)
    for t in combo:
        if t == "hflip":
            out = [f[:, ::-1] for f in out]
        elif t == "vflip":
            out = [f[::-1] for f in out]
        else:
            out = out[::-1]
    return [np.ascontiguousarray(f) for f in out]


def transform_answer(answer: Answer, combo: Sequence[str], target: str, width: int, height: int) -> Answer:
    """The teacher's answer to the transformed item (boxes in the teacher's pixels, width x height)."""
    label = answer.label
    boxes = answer.boxes
    for t in combo:
        if target == "direction" and label is not None:
            label = _MIRROR[t].get(label, label)
        if boxes is not None and t in ("hflip", "vflip"):
            boxes = tuple(replace(d, box=_mirror_box(d.box, t, width, height)) for d in boxes)
    return replace(answer, label=label, boxes=boxes)


def _mirror_box(box: Sequence[float], t: str, width: int, height: int) -> tuple[float, ...]:
    x1, y1, x2, y2 = box
    return (width - x2, y1, width - x1, y2) if t == "hflip" else (x1, height - y2, x2, height - y1)


def copy_id(item_id: str, combo: Sequence[str]) -> str:
    return f"{item_id}+{'+'.join(combo)}"


def augmented_media(fields: dict[str, Any], combo: Sequence[str], copy: str, clip_dir: Path) -> dict[str, Any]:
    """The image / video fields of one copy, from the original row's fields."""
    import cv2

    if fields.get("video"):
        from world import read_video, write_video

        done = sorted(clip_dir.glob(f"{copy}.*")) if clip_dir.is_dir() else []
        if done:  # written by an earlier run of the same domain
            return {"image": None, "video": str(done[0].resolve())}
        cap = cv2.VideoCapture(fields["video"])
        fps = cap.get(cv2.CAP_PROP_FPS) or 0.0
        cap.release()
        frames = transform_frames(read_video(fields["video"]), combo)
        clip_dir.mkdir(parents=True, exist_ok=True)
        # written under a temporary name and renamed, so an interrupted run leaves no half clip to reuse
        written = write_video(clip_dir / f".{copy}.mp4", frames, fps if 0 < fps < 1000 else 10.0)
        final = written.with_name(written.name[1:])
        written.rename(final)
        return {"image": None, "video": str(final.resolve())}
    data = np.frombuffer(fields["image"]["bytes"], np.uint8)
    picture = cv2.imdecode(data, cv2.IMREAD_UNCHANGED)
    if picture is None:
        raise ValueError(f"augment {copy}: the original picture cannot be decoded")
    ok, png = cv2.imencode(".png", transform_frames([picture], combo)[0])
    if not ok:
        raise ValueError(f"augment {copy}: the mirrored picture cannot be encoded as PNG")
    return {"image": {"bytes": png.tobytes(), "path": None}, "video": ""}


__all__ = ["TRANSFORMS", "check_augment", "combinations", "transform_frames", "transform_answer", "copy_id",
           "augmented_media"]
