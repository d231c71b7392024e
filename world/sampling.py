"""How a video is sampled and cut into chunks, shared by the video app and the distiller.

The video app sends chunks of frames to the server; the distiller must build its training clips
the same way, so both take these rules from here: `ChunkConfig` (sampling rate, chunk length,
frame size), `FrameSampler` (which source frames are kept, by timestamp), `ChunkCutter` (whole
chunks only: a trailing partial chunk is left out) and `resize_frame`.
Sampling follows the frames' timestamps, not their count, so a 25 fps file and a 30 fps camera
sampled at 5 fps both give 5 frames per second.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
        return max(1, round(self.rate(source_fps) * self.chunk_seconds))

    def rate(self, source_fps: float) -> float:
        """Sampled frames per second of a source running at `source_fps` (sampling cannot add frames)."""
        return min(self.sample_fps or source_fps, source_fps)


class FrameSampler:
    """keep(timestamp) -> whether a source frame at that time is sampled. One per reader."""

    def __init__(self, config: ChunkConfig, source_fps: float):
        if not source_fps > 0:
            raise ValueError(f"source_fps must be positive, got {source_fps!r}")
        self.source_fps = float(source_fps)
        self.rate = config.rate(self.source_fps)
        self._period = 1.0 / self.rate
        self._next_t: float | None = None

    def reset(self) -> None:
        self._next_t = None

    def keep(self, timestamp: float) -> bool:
        # Half a frame of tolerance, so 30 fps sampled at 15 fps keeps exactly every other frame.
        eps = 0.5 / self.source_fps
        if self._next_t is None or timestamp + eps >= self._next_t:
            base = timestamp if self._next_t is None else self._next_t
            self._next_t = base + self._period
            if self._next_t + eps <= timestamp:  # a gap in the source: start again from here
                self._next_t = timestamp + self._period
            return True
        return False


class ChunkCutter:
    """push(item) -> a list of exactly `frames_per_chunk` items when one is complete, else None.

    The one rule both sides cut by: the distiller's training clips and the app's chunks are whole
    chunks only. A finite recording's trailing partial chunk (its last few frames, one frame say)
    is left out on both sides: an adapter trained on chunks of N frames never saw a one-frame
    "clip", so answering one would score the adapter on an input it was never trained for.
    `finish()` says how many frames were left out."""

    def __init__(self, frames_per_chunk: int):
        if isinstance(frames_per_chunk, bool) or not isinstance(frames_per_chunk, int) or frames_per_chunk < 1:
            raise ValueError(f"frames_per_chunk must be an int >= 1, got {frames_per_chunk!r}")
        self.frames_per_chunk = frames_per_chunk
        self._buf: list = []

    @property
    def pending(self) -> int:
        return len(self._buf)

    def push(self, item) -> list | None:
        self._buf.append(item)
        if len(self._buf) < self.frames_per_chunk:
            return None
        chunk, self._buf = self._buf, []
        return chunk

    def finish(self) -> int:
        """The source ended: the partial chunk is let go; returns its number of frames (0: none)."""
        left, self._buf = len(self._buf), []
        return left

    reset = finish  # a reconnect restarts the feed: the partial chunk is let go the same way


def resize_frame(image: np.ndarray, width: int | None, height: int | None) -> np.ndarray:
    """`image` [H, W, 3] at width x height (area averaging when shrinking); as is when width is None."""
    if width is None or (image.shape[1], image.shape[0]) == (width, height):
        return image
    import cv2

    shrink = width * height < image.shape[0] * image.shape[1]
    return cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)


__all__ = ["ChunkConfig", "ChunkCutter", "FrameSampler", "resize_frame"]
