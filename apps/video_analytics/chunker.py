"""Sampling and chunking: source frames -> sampled, resized frames -> fixed-length chunks.

A stream keeps `sample_fps` frames per second of source time (None: every frame) and cuts them
into chunks of `chunk_seconds` (default 1 s; at 30 fps that is 30 frames), or of `chunk_frames`
sampled frames when that is given. Sampling follows
the frames' timestamps, not their count, so a 25 fps file and a 30 fps camera sampled at 5 fps
both give 5 frames per second. A chunk's truth is its middle frame's (the world's clips answer
counts and boxes for their middle frame too). The sampling rules (`ChunkConfig`, which frames are
kept, resizing) live in `world.sampling`, where the distiller takes them from too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from world.sampling import ChunkConfig, FrameSampler, resize_frame

from .sources import Frame, FrameTruth


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
        self._sampler = FrameSampler(config, source_fps)
        self.rate = self._sampler.rate  # sampled frames per second
        self._buf: list[Frame] = []
        self._images: list[np.ndarray] = []
        self.next_index = 0
        self.sampled = 0

    def reset(self) -> int:
        """Forget the partial chunk (after a reconnect the feed restarts); returns the frames let go."""
        lost = len(self._buf)
        self._buf, self._images = [], []
        self._sampler.reset()
        return lost

    def push(self, frame: Frame) -> Chunk | None:
        if not self._sampler.keep(frame.timestamp):
            return None
        self.sampled += 1
        self._buf.append(frame)
        self._images.append(resize_frame(frame.image, self.config.width, self.config.height))
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

