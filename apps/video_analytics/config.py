"""One stream's settings as plain dataclasses, and their construction from a config entry.

    {"name": "cam0", "source": "synthetic:0", "sample_fps": 30, "chunk_seconds": 1.0,
     "width": 224, "height": 224, "backpressure": "drop_oldest", "queue_size": 2,
     "tasks": [{"task": "count", "accuracy_target": 0.6, "latency_ms": 1000}], ...}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .backpressure import POLICIES
from .chunker import ChunkConfig
from .shadow import ShadowConfig, shadow_from_dict
from .sources import KINDS
from .tasks import TaskSpec, task_from_dict


@dataclass(frozen=True)
class ReconnectPolicy:
    max_retries: int | None = 5  # failed (re)connections in a row before the stream gives up; None: never
    backoff_s: float = 0.5  # first wait; doubles per failure up to backoff_max_s
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_retries is not None and (not isinstance(self.max_retries, int) or self.max_retries < 0):
            raise ValueError(f"reconnect.max_retries must be an int >= 0 or null, got {self.max_retries!r}")
        if not 0 <= self.backoff_s <= self.backoff_max_s:
            raise ValueError(f"reconnect needs 0 <= backoff_s <= backoff_max_s, "
                             f"got {self.backoff_s}, {self.backoff_max_s}")

    def delay(self, failures: int) -> float:
        """Seconds to wait before the attempt after `failures` failures in a row (1, 2, ...)."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, failures - 1))


@dataclass
class StreamConfig:
    name: str
    source: str
    tasks: list[TaskSpec]
    source_kind: str = "auto"  # auto | file | url | webcam | synthetic (sources.KINDS)
    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    backpressure: str = "drop_oldest"  # drop_oldest | latest_frame | block
    queue_size: int = 2  # chunks waiting for the server, at most
    realtime: bool = True  # pace reading to the source's fps, like a camera (files and synthetic)
    loop: bool = False  # files: start over at the end
    max_chunks: int | None = None  # stop after this many chunks (demos, tests); None: run until stopped
    world: dict[str, Any] = field(default_factory=dict)  # synthetic: WorldConfig fields besides the seed
    n_clips: int | None = None  # synthetic: clips to play; None: endless
    fps: float | None = None  # the source's frame rate when it does not report one
    reconnect: ReconnectPolicy = field(default_factory=ReconnectPolicy)
    annotate: str | None = None  # path of an annotated output video; None: none
    draw_truth: bool = False  # also draw ground-truth boxes in the annotated video
    encoding: str = "png"  # frames on the wire: png | jpeg | raw
    request_timeout_s: float = 60.0
    app: str = "video_analytics"  # the application tag the server sees
    shadow: ShadowConfig | None = None  # a small model answering a share of chunks beside the server (shadow.py)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a stream needs a non-empty name, got {self.name!r}")
        if self.backpressure not in POLICIES:
            raise ValueError(f"stream {self.name}: backpressure must be one of {POLICIES}, got {self.backpressure!r}")
        if self.source_kind not in KINDS:
            raise ValueError(f"stream {self.name}: source_kind must be one of {KINDS}, got {self.source_kind!r}")
        if not self.tasks:
            raise ValueError(f"stream {self.name}: give at least one task")
        labels = [t.label for t in self.tasks]
        if len(set(labels)) != len(labels):
            raise ValueError(f"stream {self.name}: task names must be unique, got {labels} "
                             "(set `name` to tell them apart)")
        self.shadow = shadow_from_dict(self.shadow, f"stream {self.name}") or None
        if self.max_chunks is not None and self.max_chunks < 1:
            raise ValueError(f"stream {self.name}: max_chunks must be >= 1 or null, got {self.max_chunks}")


_CHUNK_KEYS = {f.name for f in dataclasses.fields(ChunkConfig)}


def stream_from_dict(d: dict[str, Any]) -> StreamConfig:
    """A StreamConfig from a config entry: chunk fields (sample_fps, chunk_seconds, chunk_frames,
    width, height) sit beside the others; `tasks` is a list of TaskSpec entries."""
    d = dict(d)
    known = ({f.name for f in dataclasses.fields(StreamConfig)} - {"chunk"}) | _CHUNK_KEYS
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"stream {d.get('name', '?')}: unknown key(s) {unknown}; valid keys: {sorted(known)}")
    chunk = ChunkConfig(**{k: d.pop(k) for k in list(d) if k in _CHUNK_KEYS})
    tasks = [t if isinstance(t, TaskSpec) else task_from_dict(t) for t in d.pop("tasks", [])]
    reconnect = d.pop("reconnect", None)
    if isinstance(reconnect, dict):
        reconnect = ReconnectPolicy(**reconnect)
    return StreamConfig(tasks=tasks, chunk=chunk, reconnect=reconnect or ReconnectPolicy(), **d)
