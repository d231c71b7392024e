"""Sampling and chunking: source frames -> sampled, resized frames -> fixed-length chunks.

A stream keeps `sample_fps` frames per second of source time (None: every frame) and cuts them
into chunks of `chunk_seconds` (default 1 s; at 30 fps that is 30 frames), or of `chunk_frames`
sampled frames when that is given. Sampling follows
the frames' timestamps, not their count, so a 25 fps file and a 30 fps camera sampled at 5 fps
both give 5 frames per second. A chunk's truth is its middle frame's (the world's clips answer
counts and boxes for their middle frame too). The sampling rules (`ChunkConfig`, which frames are
kept, whole chunks only, resizing) live in `world.sampling`, where the distiller takes them from
too: a finite source's trailing partial chunk is left out here as it is in distillation.

The resize is for the model's copy only: with `keep_source` a chunk also carries its frames as the
source gave them, for a shadow teacher, which must see what distillation's teacher saw (the
recording at its own resolution), not the stream's smaller frames.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from world.sampling import ChunkConfig, ChunkCutter, FrameSampler, resize_frame

from .sources import Frame, FrameTruth


@dataclass
class Chunk:
    stream: str
    index: int  # chunk number in the stream, counting dropped ones
    frames: list[np.ndarray]  # BGR uint8 [h, w, 3] each, resized: what the model gets
    frame_indices: list[int]  # source frame numbers
    t_start: float  # source time of the first and the last frame, seconds
    t_end: float
    source_size: tuple[int, int]  # (width, height) of the source frames
    truth: FrameTruth | None = None  # the middle frame's truth
    ready: float = field(default_factory=time.perf_counter)  # wall clock when the last frame arrived
    # BGR uint8 [H, W, 3] each, as the source gave them (the shadow teacher's view); None when not kept
    source_frames: list[np.ndarray] | None = None
    shadowed: set[str] = field(default_factory=set)  # the tasks a shadow teacher answers for this chunk

    @property
    def size(self) -> tuple[int, int]:
        h, w = self.frames[0].shape[:2]
        return w, h

    def rgb(self) -> list[np.ndarray]:
        """The frames as the server takes them: RGB uint8 [h, w, 3]."""
        return [np.ascontiguousarray(f[:, :, ::-1]) for f in self.frames]

    def source_rgb(self) -> list[np.ndarray]:
        """The frames at the source's size, RGB (what a teacher takes); the model's copies when not kept."""
        return [np.ascontiguousarray(f[:, :, ::-1]) for f in (self.source_frames or self.frames)]


class Chunker:
    """push(frame) -> a Chunk when one is complete, else None. Not thread-safe (one reader).
    keep_source: chunks carry the source frames too (`Chunk.source_frames`), for a shadow teacher."""

    def __init__(self, stream: str, config: ChunkConfig, source_fps: float, keep_source: bool = False):
        if not source_fps > 0:
            raise ValueError(f"source_fps must be positive, got {source_fps!r}")
        self.stream, self.config, self.source_fps = stream, config, float(source_fps)
        self.keep_source = keep_source
        self.frames_per_chunk = config.frames_per_chunk(source_fps)
        self._sampler = FrameSampler(config, source_fps)
        self._cutter = ChunkCutter(self.frames_per_chunk)  # (source frame, resized image) pairs
        self.rate = self._sampler.rate  # sampled frames per second
        self.next_index = 0
        self.sampled = 0

    def reset(self) -> int:
        """Forget the partial chunk (after a reconnect the feed restarts); returns the frames let go."""
        self._sampler.reset()
        return self._cutter.reset()

    def push(self, frame: Frame) -> Chunk | None:
        if not self._sampler.keep(frame.timestamp):
            return None
        self.sampled += 1
        pairs = self._cutter.push((frame, resize_frame(frame.image, self.config.width, self.config.height)))
        return None if pairs is None else self._emit(pairs)

    def finish(self) -> int:
        """A finite source ended: its partial chunk is left out, as distillation leaves it out
        (world.sampling.ChunkCutter); returns the frames left out (0: none)."""
        return self._cutter.finish()

    def _emit(self, pairs: list[tuple[Frame, np.ndarray]]) -> Chunk:
        buf = [f for f, _ in pairs]
        h, w = buf[0].image.shape[:2]
        chunk = Chunk(self.stream, self.next_index, [image for _, image in pairs], [f.index for f in buf],
                      buf[0].timestamp, buf[-1].timestamp, (w, h), buf[len(buf) // 2].truth,
                      source_frames=[f.image for f in buf] if self.keep_source else None)
        self.next_index += 1
        return chunk
