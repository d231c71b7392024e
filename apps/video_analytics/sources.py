"""Frame sources: video files, RTSP / HTTP URLs, webcams (all through cv2.VideoCapture) and the
synthetic camera (the world's clips played one after another, with exact ground truth).

A source yields `Frame`s from `read()`: a BGR uint8 [H, W, 3] image, its number and its time
in the source. `read()` returns None when a finite source ends and raises `SourceError` when a
source breaks (a camera or URL that stops answering); the stream runner then reconnects by
calling `open()` again. Live sources (URL, webcam) never end: running out of frames is a break.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from world import ClipTruth, WorldConfig, render_clip

KINDS = ("auto", "file", "url", "webcam", "synthetic")
URL_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "http://", "https://", "udp://", "tcp://")


class SourceError(IOError):
    """A source that cannot be opened or stopped delivering frames (the runner retries it)."""


@dataclass
class FrameTruth:
    """Ground truth of one synthetic frame: the clip it belongs to and its position there."""

    clip: ClipTruth
    frame: int  # index into clip.frames

    @property
    def size(self) -> tuple[int, int]:
        return self.clip.width, self.clip.height


@dataclass
class Frame:
    image: np.ndarray  # BGR uint8 [H, W, 3], as OpenCV gives it
    index: int  # frame number in the source since it was (re)opened
    timestamp: float  # seconds in the source's own time: index / fps
    truth: FrameTruth | None = None


class Source(Protocol):
    name: str
    fps: float
    live: bool  # frames arrive at the source's pace whether anyone reads them or not

    def open(self) -> None: ...
    def read(self) -> Frame | None: ...
    def close(self) -> None: ...


class CaptureSource:
    """Anything cv2.VideoCapture opens: a file path, an RTSP / HTTP URL or a webcam index.

    With live=True (URLs, webcams) a failed read is a broken connection (SourceError), not the
    end; with live=False (files) it is the end, or with loop=True the file starts over.
    """

    def __init__(self, target: str | int, live: bool, loop: bool = False, fps: float | None = None,
                 open_timeout_s: float = 10.0):
        self.target, self.live, self.loop = target, live, loop
        self.name = str(target)
        self.fps = float(fps or 30.0)
        self._fps_given = fps is not None
        self.open_timeout_s = open_timeout_s
        self._cap = None
        self._index = 0

    def open(self) -> None:
        import cv2

        self.close()
        if isinstance(self.target, str) and "://" not in self.target and not Path(self.target).exists():
            raise SourceError(f"video source {self.target!r} does not exist")
        # a camera that stops answering must fail the read, not hang the stream's reader forever
        params = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, int(self.open_timeout_s * 1000),
                  cv2.CAP_PROP_READ_TIMEOUT_MSEC, int(self.open_timeout_s * 1000)]
        cap = cv2.VideoCapture(self.target, cv2.CAP_ANY, params)
        if not cap.isOpened():
            cap.release()
            raise SourceError(f"OpenCV cannot open video source {self.target!r}")
        if not self._fps_given:
            fps = cap.get(cv2.CAP_PROP_FPS)
            self.fps = float(fps) if fps and 0 < fps < 1000 else 30.0  # some cameras report 0
        self._cap, self._index = cap, 0

    def read(self) -> Frame | None:
        if self._cap is None:
            raise SourceError(f"video source {self.name!r} is not open")
        ok, image = self._cap.read()
        if not ok or image is None:
            if self.live:
                raise SourceError(f"video source {self.name!r} stopped delivering frames after {self._index}")
            if self.loop and self._index > 0:
                self.open()
                return self.read()
            return None
        if image.ndim == 2:  # grey cameras
            image = np.repeat(image[:, :, None], 3, axis=2)
        frame = Frame(image, self._index, self._index / self.fps)
        self._index += 1
        return frame

    def close(self) -> None:
        if self._cap is not None:
            self._cap.release()
            self._cap = None


class SyntheticCamera:
    """The world's clips start..start+n_clips-1 (or endlessly) played back to back, each frame
    with its truth. Clip i is `render_clip(world, i)`, so the same seed replays the same feed."""

    live = True

    def __init__(self, world: WorldConfig, start: int = 0, n_clips: int | None = None, name: str | None = None):
        self.world, self.start, self.n_clips = world, start, n_clips
        self.name = name or f"synthetic:{world.seed}"
        self.fps = float(world.fps)
        self._clip = start
        self._frames: list[np.ndarray] = []
        self._truth: ClipTruth | None = None
        self._pos = 0
        self._index = 0

    def open(self) -> None:
        self._index = 0  # a reopened camera goes on with the next clip, like a live feed would

    def read(self) -> Frame | None:
        if self._pos >= len(self._frames):
            if self.n_clips is not None and self._clip >= self.start + self.n_clips:
                return None
            self._frames, self._truth = render_clip(self.world, self._clip)
            self._clip, self._pos = self._clip + 1, 0
        t = self._pos
        frame = Frame(self._frames[t], self._index, self._index / self.fps, FrameTruth(self._truth, t))
        self._pos += 1
        self._index += 1
        return frame

    def close(self) -> None:
        pass


class Pacer:
    """Sleeps so that frame i is handed out no earlier than i / fps after the first one: a file
    or the synthetic camera then behaves like a camera running in real time."""

    def __init__(self, fps: float):
        if not fps > 0:
            raise ValueError(f"Pacer: fps must be positive, got {fps!r}")
        self.period = 1.0 / fps
        self._t0: float | None = None
        self._n = 0

    def reset(self) -> None:
        self._t0, self._n = None, 0

    def wait(self, stop=None) -> None:
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        due = self._t0 + self._n * self.period
        self._n += 1
        if due > now:
            if stop is not None:
                stop.wait(due - now)
            else:
                time.sleep(due - now)


def source_kind(spec: str | int) -> str:
    """What a source string names: "synthetic:<seed>[:<first clip>]", a webcam index, a URL or a file."""
    if isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
        return "webcam"
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"source must be a file path, a URL, a webcam index or 'synthetic:<seed>', got {spec!r}")
    if spec.startswith("synthetic"):
        return "synthetic"
    if spec.lower().startswith(URL_SCHEMES):
        return "url"
    return "file"


def open_source(spec: str | int, kind: str = "auto", world: dict[str, Any] | None = None, loop: bool = False,
                n_clips: int | None = None, fps: float | None = None) -> Source:
    """Build (not yet open) the source a stream config names. `kind` overrides the guess from the
    string, e.g. kind="url" plays a file through the live-URL code path."""
    if kind not in KINDS:
        raise ValueError(f"source kind must be one of {KINDS}, got {kind!r}")
    kind = source_kind(spec) if kind == "auto" else kind
    if kind == "synthetic":
        parts = str(spec).split(":")
        try:
            seed = int(parts[1]) if len(parts) > 1 and parts[1] else 0
            start = int(parts[2]) if len(parts) > 2 else 0
        except ValueError:
            raise ValueError(f"a synthetic source is 'synthetic:<seed>' or 'synthetic:<seed>:<first clip>', "
                             f"got {spec!r}") from None
        return SyntheticCamera(WorldConfig(**{**(world or {}), "seed": seed}), start, n_clips, name=str(spec))
    if kind == "webcam":
        return CaptureSource(int(spec), live=True, fps=fps)
    if kind == "url":
        return CaptureSource(str(spec), live=True, fps=fps)
    return CaptureSource(str(spec), live=False, loop=loop, fps=fps)
