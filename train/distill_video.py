"""A user's recording as a distillation source: chunks exactly as the video app sends them.

The recording is read once with OpenCV; frames are kept at the app's sampling rate (by
timestamp, `world.sampling`), resized to the app's width x height and cut into chunks of
`chunk_frames` (or `chunk_seconds` of sampled frames); a last, shorter chunk is left out. Each
chunk is written as its own small clip file (what the dataset's `video` column points to and
the model reads), under `<world_dir>/video-<stem>-<hash>/`, with `chunks.json` listing the
source frames and times of every chunk; a second run with the same file and chunking reuses
them. The teacher looks at the same sampled frames at the recording's own resolution (read
again from the recording), so its labels are not limited by the app's frame size.

Train / eval split: by time. Eval is the final stretch of the recording (the last
`eval_fraction` of its chunks), so no eval chunk sits between two train chunks and neighbouring,
near-identical frames do not leak from train into eval (only the one boundary is shared).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, TextIO

import numpy as np

from world import write_video
from world.progress import ProgressLine
from world.sampling import ChunkCutter, FrameSampler, resize_frame

from .distill_sources import Item, SourceError, SourceSpec, file_identity
from .distill_spec import fingerprint
from .teachers import Sample

INDEX = "chunks.json"


def _open(path: Path):
    import cv2

    cap = cv2.VideoCapture(str(path))
    if not cap.isOpened():
        cap.release()
        raise SourceError(f"OpenCV cannot open video {path}")
    return cap


class VideoSource:
    media = "clip"
    classes = labels = None

    def __init__(self, spec: SourceSpec, where: str):
        import cv2

        self.spec, self.where, self.path = spec, where, Path(spec.path)
        if not self.path.is_file():
            raise SourceError(f"{where}: source video {self.path} does not exist")
        cap = _open(self.path)
        fps = cap.get(cv2.CAP_PROP_FPS)
        self.frame_count = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        self.size = (int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)))
        cap.release()
        self.file_fps = float(fps) if fps and 0 < fps < 1000 else None
        self.fps = self.file_fps or spec.fps
        if not self.fps:
            raise SourceError(f"{where}: video {self.path} reports no frame rate; set source.fps")
        self.chunking = spec.chunk_config(where)
        self.chunk_frames = self.chunking.frames_per_chunk(self.fps)
        w, h = (spec.width, spec.height) if spec.width else self.size
        if w % 2 or h % 2:
            raise SourceError(f"{where}: chunks of {w}x{h} cannot be encoded (odd size); set source width/height")
        self.identity = file_identity(self.path)
        self.items: list[Item] = []

    def fingerprint(self) -> str:
        return fingerprint(self.identity, self.fps, self.spec.to_dict())

    def _frames(self) -> Iterator[tuple[int, float, np.ndarray]]:
        """(source frame number, time, BGR frame) of every sampled frame of the recording."""
        cap, sampler, i = _open(self.path), FrameSampler(self.chunking, self.fps), 0
        try:
            while True:
                ok, frame = cap.read()
                if not ok or frame is None:
                    break
                t = i / self.fps
                if sampler.keep(t):
                    yield i, t, (np.repeat(frame[:, :, None], 3, axis=2) if frame.ndim == 2 else frame)
                i += 1
        finally:
            cap.release()

    def _chunks(self) -> Iterator[list[tuple[int, float, np.ndarray]]]:
        cutter = ChunkCutter(self.chunk_frames)  # the app's rule: whole chunks only, the tail left out
        for f in self._frames():
            chunk = cutter.push(f)
            if chunk is not None:
                yield chunk

    def prepare(self, world_dir: str, log: TextIO | None = None, progress: bool = False) -> list[Item]:
        """Writes every chunk as a clip file once (resumable: a complete chunks.json is reused)."""
        out = Path(world_dir) / f"video-{self.path.stem}-{self.fingerprint()[:10]}"
        index = out / INDEX
        if index.is_file():
            records = json.loads(index.read_text())["chunks"]
        else:
            (out / "chunks").mkdir(parents=True, exist_ok=True)
            records, bar = [], ProgressLine(log)
            for n, chunk in enumerate(self._chunks()):
                frames = [resize_frame(f, self.spec.width, self.spec.height) for _, _, f in chunk]
                file = write_video(out / "chunks" / f"{n:06d}.mp4", frames, self.chunking.rate(self.fps))
                records.append({"id": f"chunk-{n:06d}", "file": str(file.relative_to(out)),
                                "frames": [i for i, _, _ in chunk], "t_start": round(chunk[0][1], 4),
                                "t_end": round(chunk[-1][1], 4)})
                if progress and log is not None:
                    bar.update(f"  {self.path.name}: {n + 1} chunks written")
            if progress and log is not None and records:
                bar.end()
            index.write_text(json.dumps({"source": str(self.path.resolve()), "chunks": records}, indent=1) + "\n")
        if len(records) < 2:
            raise SourceError(f"{self.where}: video {self.path} gives {len(records)} whole chunk(s) of "
                              f"{self.chunk_frames} frames at {self.chunking.rate(self.fps):g} fps; at least 2 are "
                              f"needed (a longer recording, or shorter chunks)")
        self.dir = out
        self.items = [Item(r["id"], "clip", video=str((out / r["file"]).resolve()), n_frames=len(r["frames"]),
                           time=r["t_start"], extra={"frames": r["frames"], "t_end": r["t_end"]}) for r in records]
        return self.items

    def samples(self, items: list[Item]) -> Iterator[Sample]:
        """The teacher's view of `items`, in recording order: the chunk's sampled frames, RGB."""
        want = {it.id: it for it in items}
        frame_to_chunk = {i: it.id for it in items for i in it.extra["frames"]}
        pending: dict[str, list[np.ndarray]] = {}
        for i, _, frame in self._frames():
            cid = frame_to_chunk.get(i)
            if cid is None:
                continue
            pending.setdefault(cid, []).append(np.ascontiguousarray(frame[:, :, ::-1]))
            if len(pending[cid]) == len(want[cid].extra["frames"]):
                yield Sample(cid, "clip", pending.pop(cid))

    def record(self) -> dict[str, Any]:
        return {**self.spec.to_dict(), "path": str(self.path.resolve()), "fps": self.file_fps or self.fps,
                "fps_from_file": self.file_fps is not None, "frame_count": self.frame_count,
                "frame_size": list(self.size), "sampled_fps": self.chunking.rate(self.fps),
                "chunk_frames": self.chunk_frames, "chunks": len(self.items),
                "chunk_size": [self.spec.width or self.size[0], self.spec.height or self.size[1]],
                "chunks_dir": str(getattr(self, "dir", "")), "identity": self.identity}


def time_split(items: list[Item], eval_fraction: float) -> tuple[set[str], set[str], float]:
    """(train ids, eval ids, time where eval starts): eval is the final stretch of the recording."""
    order = sorted(items, key=lambda it: it.time)
    n_eval = min(max(1, round(len(order) * eval_fraction)), len(order) - 1)
    train, tail = order[:-n_eval], order[-n_eval:]
    return {it.id for it in train}, {it.id for it in tail}, tail[0].time


__all__ = ["VideoSource", "time_split"]
