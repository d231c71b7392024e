"""One stream: a reader thread (source -> chunker -> bounded queue) and a worker thread (queue ->
the server, one request per task, -> metrics, sink, annotated video).

The reader never waits on the server: when chunks come faster than they are answered, the
queue's policy drops them (see backpressure.py). A broken source is reopened with exponential
backoff; after `reconnect.max_retries` failures in a row the stream reports itself failed,
while every other stream goes on. The worker talks to the server through a client object with
`submit_video(prompt, frames, ...) -> stream` (serve.rpc.Client), polled without blocking so
the tasks of a chunk run side by side on the server.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from apps.common.annotate import Annotator
from apps.common.routing import Route

from .backpressure import BoundedQueue, Closed
from .chunker import Chunk, Chunker
from .config import StreamConfig
from .metrics import StreamMetrics
from .process import run_chunk
from .shadow_worker import ShadowWorker, shadow_groups
from .sources import Pacer, SourceError, open_source
from .tasks import TaskSpec


def _base_route(spec: TaskSpec) -> Route:
    return Route(spec.key, None, None, "generate", reason="no routing given: base model")


class StreamRunner:
    def __init__(self, config: StreamConfig, client, routes: dict[str, Route] | None = None, sink=None):
        self.config, self.client, self.sink = config, client, sink
        self.routes = {t.label: (routes or {}).get(t.label) or _base_route(t) for t in config.tasks}
        self.queue: BoundedQueue[Chunk] = BoundedQueue(config.queue_size, config.backpressure)
        self.metrics = StreamMetrics(config.name, [t.label for t in config.tasks],
                                     {t.label for t in config.tasks if t.task == "detect"})
        self.annotator: Annotator | None = None
        self.sample_rate: float | None = None  # sampled frames per second, once the source is open
        self.warnings: list[str] = []  # set by the manager at start (resolution.py): frame sizes unlike distillation's
        groups = shadow_groups(config.shadow, config.tasks)
        self.shadow = ShadowWorker(config.name, groups) if groups else None  # off the latency path
        self._stop = threading.Event()
        self._drain = True
        self._threads = [threading.Thread(target=self._read_loop, name=f"{config.name}-reader", daemon=True),
                         threading.Thread(target=self._work_loop, name=f"{config.name}-worker", daemon=True)]

    # ---- control ---------------------------------------------------------------------------------
    def start(self) -> "StreamRunner":
        if self.shadow is not None:
            self.shadow.start()
        for t in self._threads:
            t.start()
        return self

    def stop(self, drain: bool = False) -> None:
        """Stop reading; the chunks still queued are answered when `drain`, else dropped (and
        counted as drops, so chunks made = processed + dropped + failed still holds)."""
        self._drain = drain
        self._stop.set()
        if not drain:
            self.queue.clear()
        self.queue.close()

    def join(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self.shadow is not None and self.done:  # its last comparisons, within the same deadline
            self.shadow.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self.done

    @property
    def done(self) -> bool:
        return not any(t.is_alive() for t in self._threads)

    def snapshot(self) -> dict[str, Any]:
        snap = self.metrics.snapshot(self.queue.stats.to_dict())
        snap["routes"] = {name: r.to_dict() for name, r in self.routes.items()}
        if self.warnings:
            snap["warnings"] = list(self.warnings)
        if self.shadow is not None:
            shadow = self.shadow.snapshot()
            for name, agreement in shadow.pop("tasks").items():
                snap["tasks"][name]["shadow"] = agreement
            snap["shadow"] = shadow
        if self.annotator is not None and self.annotator.path is not None:
            snap["annotated"] = str(self.annotator.path)
        return snap

    def route_lines(self) -> list[str]:
        """One line per task: where it is served and why, with the adapter's expected accuracy beside
        the baseline its training recorded (a route no better than its baseline says so)."""
        return [f"stream {self.config.name}, task {label}: {r.cell()}: {r.reason}" for label, r in self.routes.items()]

    def event(self, event: str, **fields) -> None:
        self.record({"type": "event", "stream": self.config.name, "event": event, **fields})

    def record(self, record: dict[str, Any]) -> None:
        if self.sink is not None:
            self.sink.write(record)

    # ---- reader ----------------------------------------------------------------------------------
    def _read_loop(self) -> None:
        cfg, m = self.config, self.metrics
        try:
            source = open_source(cfg.source, cfg.source_kind, cfg.world, cfg.loop, cfg.n_clips, cfg.fps)
        except ValueError as e:
            m.set_status("failed", str(e))
            self.event("failed", error=str(e))
            self.queue.close()
            return
        chunker: Chunker | None = None
        failures, ended, opened_before = 0, False, False
        try:
            while not self._stop.is_set() and not ended:
                try:
                    source.open()
                    if opened_before:
                        m.add(reconnects=1)
                        self.event("reconnected", attempt=failures)
                    opened_before = True
                    m.set_status("running")
                    chunker = chunker or Chunker(cfg.name, cfg.chunk, source.fps, keep_source=self.shadow is not None)
                    self.sample_rate = chunker.rate
                    pacer = Pacer(source.fps) if cfg.realtime else None
                    while not self._stop.is_set():
                        if pacer is not None:
                            pacer.wait(self._stop)
                        frame = source.read()
                        if frame is None:
                            ended = True
                            break
                        failures = 0
                        sampled = chunker.sampled
                        chunk = chunker.push(frame)
                        m.add(frames_in=1, frames_sampled=chunker.sampled - sampled)
                        if chunk is not None and not self._offer(chunk):
                            return
                        if cfg.max_chunks is not None and chunker.next_index >= cfg.max_chunks:
                            ended = True
                            break
                except SourceError as e:
                    source.close()
                    failures += 1
                    m.add(source_errors=1, frames_lost=chunker.reset() if chunker else 0)
                    if cfg.reconnect.max_retries is not None and failures > cfg.reconnect.max_retries:
                        m.set_status("failed", f"{e} (gave up after {failures - 1} retries)")
                        self.event("failed", error=str(e), failures=failures)
                        return
                    delay = cfg.reconnect.delay(failures)
                    m.set_status("reconnecting", str(e))
                    self.event("reconnecting", error=str(e), failures=failures, backoff_s=delay)
                    self._stop.wait(delay)
            if ended and chunker is not None and not self._stop.is_set():
                left = chunker.finish()  # whole chunks only, as distillation cut the recording
                if left:
                    self.event("tail_left_out", frames=left, frames_per_chunk=chunker.frames_per_chunk)
        except Exception as e:  # a bug or an unexpected OpenCV error: this stream only
            m.set_status("failed", f"{type(e).__name__}: {e}")
            self.event("failed", error=f"{type(e).__name__}: {e}")
        finally:
            source.close()
            self.queue.close()

    def _offer(self, chunk: Chunk) -> bool:
        if self.shadow is not None:  # the coin is tossed here so that only a shadowed chunk holds its source frames
            chunk.shadowed = self.shadow.sample()
        if not chunk.shadowed:
            chunk.source_frames = None
        self.metrics.add(chunks_made=1)  # before the put, so a live snapshot never shows processed > made
        try:
            self.queue.put(chunk)
        except Closed:  # the stream was stopped: this chunk was never made available
            self.metrics.add(chunks_made=-1)
            return False
        return True

    # ---- worker ----------------------------------------------------------------------------------
    def _work_loop(self) -> None:
        try:
            while True:
                if self._stop.is_set() and not self._drain:
                    self.queue.clear()  # a chunk the reader put in just before it saw the stop
                    break
                chunk = self.queue.get(timeout=0.2)
                if chunk is None:
                    if self.queue.drained:
                        break
                    continue
                self._process(chunk)
        finally:
            if self.shadow is not None:
                self.shadow.close(drain=self._drain or not self._stop.is_set())
            if self.annotator is not None:
                self.annotator.close()
            if self.metrics.status != "failed":
                self.metrics.set_status("stopped" if self._stop.is_set() else "finished")
            self.event(self.metrics.status, metrics=self.metrics.snapshot(self.queue.stats.to_dict()))

    def submit(self, spec: TaskSpec, frames, chunk: Chunk):
        route = self.routes[spec.label]
        # a domain trained on pictures gets the chunk's middle frame as a picture (the frame the
        # chunk's truth describes): a clip of 30 frames is not what its head learnt to read
        send, media = ((self.client.submit_image, frames[len(frames) // 2]) if route.media == "image"
                       else (self.client.submit_video, frames))
        return send(spec.asked(route), media, adapter=route.adapter, output_mode=route.output_mode,
                    sampling=spec.sampling_params(), app=self.config.app, slo_ms=spec.latency_ms,
                    tag=f"{self.config.name}/{chunk.index}/{spec.label}", encoding=self.config.encoding,
                    # an adapter fused from several domains has a head per domain
                    task=route.head if route.output_mode == "head" else None)

    def _process(self, chunk: Chunk) -> None:
        run_chunk(self, chunk)
