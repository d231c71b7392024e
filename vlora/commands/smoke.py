"""`vlora smoke`: every tiny zoo model through the Hugging Face Auto classes on the world.

It builds whatever is missing (the tiny zoo, a small synthetic world), then asks every tiny
model questions about the world's images and clips through the Hugging Face Auto classes and
prints a per-model report with latency and exact-match accuracy against the ground truth. The
zoo's weights are random, so accuracy is that of an untrained model; the run shows that the
whole path (checkpoints, processors, chat templates, image and video inputs, real video files)
works end to end.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import cv2
import torch
from omegaconf import DictConfig

from world import WorldItem, write_world
from zoo import load_pretrained

from ..config import to_dataclass
from .world import world_job
from .table import format_table
from .zoo import ZooJob, build_zoo


@dataclass
class DemoJob:
    models: list[str]
    max_new_tokens: int
    n_queries: int
    report: str


@dataclass
class QueryResult:
    model: str
    item: str
    question: str
    truth: str
    answer: str
    latency_ms: float
    new_tokens: int

    @property
    def correct(self) -> bool:
        return self.answer.strip().lower() == self.truth.strip().lower()


@dataclass
class ModelReport:
    model: str
    load_ms: float
    queries: list[QueryResult] = field(default_factory=list)

    def summary(self) -> dict:
        lat = sorted(q.latency_ms for q in self.queries)
        return {
            "model": self.model, "queries": len(self.queries), "load_ms": round(self.load_ms, 1),
            "p50_ms": round(statistics.median(lat), 1) if lat else None,
            "max_ms": round(lat[-1], 1) if lat else None,
            "accuracy": round(sum(q.correct for q in self.queries) / len(self.queries), 3) if lat else None,
        }


def _rgb(frame):
    return cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)


def ask(model, processor, item: WorldItem, question: str, max_new_tokens: int) -> tuple[str, float, int]:
    """One question about one world item (image, or clip as a video); returns (answer, ms, tokens)."""
    media = item.load()
    kind = "video" if item.kind == "clip" else "image"
    messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    visual = {"videos": [[_rgb(f) for f in media]]} if kind == "video" else {"images": [_rgb(media)]}
    start = time.perf_counter()
    inputs = processor(text=[text], return_tensors="pt", **visual)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    elapsed = (time.perf_counter() - start) * 1e3
    return processor.decode(new, skip_special_tokens=True), elapsed, int(new.numel())


def run_model(name: str, path: Path, items: list[WorldItem], job: DemoJob, log=None) -> ModelReport:
    start = time.perf_counter()
    model, processor = load_pretrained(path)
    report = ModelReport(name, (time.perf_counter() - start) * 1e3)
    takes_video = getattr(processor, "video_processor", None) is not None  # LLaVA-1.5 takes images only
    for item in items:
        if item.kind == "clip" and not takes_video:
            continue
        qa = item.qa[0]
        answer, ms, n = ask(model, processor, item, qa.question, job.max_new_tokens)
        report.queries.append(QueryResult(name, item.file, qa.question, qa.answer, answer, ms, n))
        print(f"  {name} {item.file}: {qa.question!r} -> {answer!r} (truth {qa.answer!r}, {ms:.0f} ms)",
              file=log or sys.stderr, flush=True)
    return report


def run(cfg: DictConfig) -> dict:
    job = to_dataclass(DemoJob, cfg.smoke)
    zoo = build_zoo(ZooJob(models=job.models, dir=cfg.paths.zoo, seed=cfg.seed))
    world_cfg, world = world_job(cfg)
    index = write_world(world_cfg, world.dir, n_images=world.n_images, n_clips=world.n_clips)
    items = index.images[: job.n_queries] + index.clips[: job.n_queries]
    reports = [run_model(name, zoo[name], items, job) for name in job.models]
    summary = {"world": str(index.root), "models": [r.summary() for r in reports],
               "queries": [asdict(q) | {"correct": q.correct} for r in reports for q in r.queries]}
    out = Path(job.report)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print("\nV-LoRA demo: tiny zoo (random weights) on the synthetic world\n")
    print(format_table(summary["models"]))
    print(f"\nreport: {out}")
    return summary
