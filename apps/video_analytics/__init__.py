"""Video analytics: camera streams cut into chunks, each task answered by the adapter the fusion
manifest picks for its accuracy target, with per-stream live metrics.

    with StreamManager(lambda: Client(host, port, token), manifest, JsonlSink("results.jsonl")) as m:
        m.add(stream_from_dict({"name": "cam0", "source": "synthetic:0", "width": 112, "height": 112,
                                "tasks": [{"task": "count", "accuracy_target": 0.6, "latency_ms": 1000}]}))
        time.sleep(10); print(m.snapshot()["cam0"]["latency_ms"])

Roles: `sources` (files, URLs, webcams, the synthetic camera), `chunker` (sampling, resizing,
chunks), `backpressure` (bounded queues, drop policies), `tasks` (prompts, ground truth,
scoring), `answers` (head output or parsed text -> Prediction), `routing` (manifest -> adapter,
head, output mode), `stream` / `process` (one stream's threads), `manager` (many streams),
`metrics`, `sink`, `shadow` / `shadow_worker` (a small model of the user's answering a share
of chunks on its own thread, on the source's frames, its agreement with the served answers
reported per task), `resolution` (the start check: frame sizes against what distillation recorded);
`answers`, `routing` and `annotate` are shared with visual retrieval (apps/common). Only
`stream`/`process` touch the server, through a client with `submit_video`; everything else is
plain Python and testable alone.
"""

from apps.common.annotate import Annotator, draw_banner, draw_boxes
from apps.common.answers import (Prediction, f1, from_head, from_text, iou, match_boxes, parse_boxes,
                                 parse_count, parse_label, parse_yes_no)
from apps.common.routing import Route, ServerCaps, load_manifest, resolve_route
from apps.common.stats import percentiles

from .backpressure import POLICIES, BoundedQueue, Closed, QueueStats
from .chunker import Chunk, ChunkConfig, Chunker
from .config import ReconnectPolicy, StreamConfig, stream_from_dict
from .manager import StreamManager
from .metrics import StreamMetrics, format_line
from .shadow import ShadowConfig, shadow_from_dict
from .shadow_worker import ShadowWorker
from .sink import JsonlSink, read_jsonl
from .sources import (CaptureSource, Frame, FrameTruth, Pacer, Source, SourceError, SyntheticCamera, open_source,
                      source_kind)
from .stream import StreamRunner
from .tasks import TASKS, TaskSpec, task_from_dict

__all__ = [
    "StreamManager", "StreamRunner", "StreamConfig", "ReconnectPolicy", "stream_from_dict",
    "Source", "CaptureSource", "SyntheticCamera", "Frame", "FrameTruth", "SourceError", "Pacer", "open_source",
    "source_kind", "Chunk", "ChunkConfig", "Chunker", "BoundedQueue", "QueueStats", "Closed", "POLICIES",
    "TaskSpec", "TASKS", "task_from_dict", "Route", "ServerCaps", "resolve_route", "load_manifest",
    "Prediction", "from_head", "from_text", "parse_count", "parse_yes_no", "parse_label", "parse_boxes",
    "iou", "match_boxes", "f1", "StreamMetrics", "percentiles", "format_line", "Annotator", "draw_boxes",
    "draw_banner", "JsonlSink", "read_jsonl", "ShadowConfig", "ShadowWorker", "shadow_from_dict",
]
