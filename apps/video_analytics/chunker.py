"""Sampling and chunking: source frames -> sampled, resized frames -> fixed-length chunks.

A stream keeps `sample_fps` frames per second of source time (None: every frame) and cuts them
into chunks of `chunk_seconds` (default 1 s; at 30 fps that is 30 frames), or of `chunk_frames`
sampled frames when that is given. Sampling follows
the frames' timestamps, not their count, so a 25 fps file and a 30 fps camera sampled at 5 fps
both give 5 frames per second. A chunk's truth is its middle frame's (the world's clips answer
counts and boxes for their middle frame too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .sources import Frame, FrameTruth


@dataclass(frozen=True)
class ChunkConfig:
    sample_fps: float | None = None  # frames kept per second of source time; None = all
    chunk_seconds: float = 1.0
    chunk_frames: int | None = None  # sampled frames per chunk; overrides chunk_seconds
    width: int | None = None  # frames are resized to width x height; None keeps the source size
    height: int | None = None

    def __post_init__(self) -> None:
        if self.sample_fps is not None and not self.sample_fps > 0:
            raise ValueError(f"sample_fps must be a positive number of frames per second or null, "
                             f"got {self.sample_fps!r}")
        if not self.chunk_seconds > 0:
            raise ValueError(f"chunk_seconds must be positive, got {self.chunk_seconds!r}")
        if self.chunk_frames is not None and (isinstance(self.chunk_frames, bool) or
                                              not isinstance(self.chunk_frames, int) or self.chunk_frames < 1):
            raise ValueError(f"chunk_frames must be an int >= 1 or null, got {self.chunk_frames!r}")
        for name in ("width", "height"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 8):
                raise ValueError(f"{name} must be an int of at least 8 pixels or null, got {v!r}")
        if (self.width is None) != (self.height is None):
            raise ValueError(f"give both width and height or neither, got {self.width!r} x {self.height!r}")

    def frames_per_chunk(self, source_fps: float) -> int:
        if self.chunk_frames is not None:
            return self.chunk_frames
        rate = self.sample_fps if self.sample_fps is not None else source_fps
        rate = min(rate, source_fps)  # sampling cannot add frames
        return max(1, round(rate * self.chunk_seconds))


@dataclass
class Chunk:
    stream: str
    index: int  # chunk number in the stream, counting dropped ones
    frames: list[np.ndarray]  # BGR uint8 [h, w, 3] each, resized
    frame_indices: list[int]  # source frame numbers
    t_start: float  # source time of the first and the last frame, seconds
    t_end: float
    source_size: tuple[int, int]  # (width, height) of the source frames
    truth: FrameTruth | None = None  # the middle frame's truth
    ready: float = field(default_factory=time.perf_counter)  # wall clock when the last frame arrived

    @property
    def size(self) -> tuple[int, int]:
        h, w = self.frames[0].shape[:2]
        return w, h

    def rgb(self) -> list[np.ndarray]:
        """The frames as the server takes them: RGB uint8 [h, w, 3]."""
        return [np.ascontiguousarray(f[:, :, ::-1]) for f in self.frames]


class Chunker:
    """push(frame) -> a Chunk when one is complete, else None. Not thread-safe (one reader)."""

    def __init__(self, stream: str, config: ChunkConfig, source_fps: float):
        if not source_fps > 0:
            raise ValueError(f"source_fps must be positive, got {source_fps!r}")
        self.stream, self.config, self.source_fps = stream, config, float(source_fps)
        self.frames_per_chunk = config.frames_per_chunk(source_fps)
        self.rate = min(config.sample_fps or source_fps, source_fps)  # sampled frames per second
        self._period = 1.0 / self.rate
        self._next_t: float | None = None
        self._buf: list[Frame] = []
        self._images: list[np.ndarray] = []
        self.next_index = 0
        self.sampled = 0

    def reset(self) -> int:
        """Forget the partial chunk (after a reconnect the feed restarts); returns the frames let go."""
        lost = len(self._buf)
        self._buf, self._images, self._next_t = [], [], None
        return lost

    def _keep(self, frame: Frame) -> bool:
        # Half a frame of tolerance, so 30 fps sampled at 15 fps keeps exactly every other frame.
        eps = 0.5 / self.source_fps
        if self._next_t is None or frame.timestamp + eps >= self._next_t:
            base = frame.timestamp if self._next_t is None else self._next_t
            self._next_t = base + self._period
            if self._next_t + eps <= frame.timestamp:  # a gap in the source: start again from here
                self._next_t = frame.timestamp + self._period
            return True
        return False

    def _resize(self, image: np.ndarray) -> np.ndarray:
        w, h = self.config.width, self.config.height
        if w is None or (image.shape[1], image.shape[0]) == (w, h):
            return image
        import cv2

        shrink = w * h < image.shape[0] * image.shape[1]
        return cv2.resize(image, (w, h), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)

    def push(self, frame: Frame) -> Chunk | None:
        if not self._keep(frame):
            return None
        self.sampled += 1
        self._buf.append(frame)
        self._images.append(self._resize(frame.image))
        if len(self._buf) < self.frames_per_chunk:
            return None
        return self._emit()

    def flush(self) -> Chunk | None:
        """The partial chunk at the end of a finite source, or None."""
        return self._emit() if self._buf else None

    def _emit(self) -> Chunk:
        buf, images = self._buf, self._images
        self._buf, self._images = [], []
        h, w = buf[0].image.shape[:2]
        chunk = Chunk(self.stream, self.next_index, images, [f.index for f in buf], buf[0].timestamp,
                      buf[-1].timestamp, (w, h), buf[len(buf) // 2].truth)
        self.next_index += 1
        return chunk

