"""The distiller: one teacher over representative world frames or clips -> one dataset per domain.

    specs = [DomainSpec(name="count_vehicles", task="count", target="count", teacher="yolo_world",
                        classes=["car", "bus", "truck"], question="How many vehicles are there?")]
    results = distill(specs, TeacherSettings(dir=".vlora/teachers"),
                      DistillJob(datasets_dir=".vlora/datasets", world_dir=".vlora/world"))
    dd, meta = load_distilled(".vlora/datasets/count_vehicles")      # DatasetDict + domain.json

Frames come from a world written with `world.write_world` (PNG images; clips as real .mp4
files that the dataset references by path). Prompts are the question in the chat format of the
configured model, rendered by its own processor (the zoo builds the checkpoint if missing).
Resumable at two levels: a finished domain whose fingerprint (spec, teacher weights, model,
chat template) matches is kept as is; an interrupted one resumes from its cached teacher answers
(`<datasets_dir>/.work/<domain>-<fingerprint>.jsonl`). Besides the contract's fields, domain.json
records how often the teacher agrees with the world's ground truth on the domain's items.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from world import WorldIndex, WorldItem, write_world

from .distill_io import (CREATED_BY, DOMAIN_FILE, AnswerCache, dump_answer, evenly_spaced, load_answer,
                         load_distilled, read_domain, save_domain, split_ids, target_fields)
from .distill_spec import VERSION, DistillJob, DomainError, DomainSpec, fingerprint, world_key
from .teachers import (Query, Sample, Teacher, TeacherError, TeacherSettings, build_teacher,
                       teacher_fingerprint, teacher_targets, truth_answer)

CHUNK = 32  # items per teacher call (YOLO predicts a chunk as one batch)


@dataclass
class DistillResult:
    name: str
    path: Path
    status: str            # "built" | "kept"
    sizes: dict[str, int]
    agreement: dict | None  # teacher vs ground truth on the domain's items
    seconds: float


# ----------------------------------------------------------------------------- prompts
class PromptRenderer:
    """Question -> prompt in the model's chat format with its image / video placeholder."""

    def __init__(self, job: DistillJob):
        from transformers import AutoProcessor

        from zoo import SPECS, build_checkpoint

        path = Path(job.model_path) if job.model_path else None
        if path is None or not (path / "config.json").is_file():
            if job.model not in SPECS:
                raise DomainError(f"model {job.model!r} has no checkpoint at {path} and is not a zoo model "
                                  f"({sorted(SPECS)}); set model.path to a checkpoint directory")
            if path is None:
                raise DomainError(f"model {job.model!r}: no model_path given to build the zoo checkpoint into")
            build_checkpoint(job.model, path, seed=job.zoo_seed)
        self.processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        self.takes_video = getattr(self.processor, "video_processor", None) is not None
        self.model = job.model
        self.template = getattr(self.processor, "chat_template", None) or ""
        self._cache: dict[tuple[str, str], str] = {}

    def __call__(self, question: str, media: str) -> str:
        key = (question, media)
        if key not in self._cache:
            if media == "clip" and not self.takes_video:
                raise DomainError(f"model {self.model!r} takes no video; clip domains need a video model "
                                  f"(qwen2_vl_*, qwen2_5_vl_*)")
            content = [{"type": "video" if media == "clip" else "image"}, {"type": "text", "text": question}]
            self._cache[key] = self.processor.apply_chat_template([{"role": "user", "content": content}],
                                                                  add_generation_prompt=True)
        return self._cache[key]


# ----------------------------------------------------------------------------- worlds
def prepare_worlds(specs: list[DomainSpec], job: DistillJob) -> dict[str, WorldIndex]:
    """Writes (or finishes) one world per distinct world config, with as many images and clips
    as its largest domain needs; returns domain name -> world."""
    need: dict[str, list] = {}
    for s in specs:
        cfg = s.world_config()
        entry = need.setdefault(world_key(cfg), [cfg, 0, 0])
        entry[1 if s.media == "image" else 2] = max(entry[1 if s.media == "image" else 2], s.size)
    worlds = {key: write_world(cfg, Path(job.world_dir) / key, n_images=n_img, n_clips=n_clip,
                               progress=job.progress)
              for key, (cfg, n_img, n_clip) in need.items()}
    return {s.name: worlds[world_key(s.world_config())] for s in specs}


def _rgb(item: WorldItem) -> list[np.ndarray]:
    media = item.load()  # BGR, as OpenCV reads it
    frames = media if isinstance(media, list) else [media]
    return [np.ascontiguousarray(f[..., ::-1]) for f in frames]


def _qa(item: WorldItem) -> list[tuple[str, str]]:
    return [(q.question, q.answer) for q in item.qa]


# ----------------------------------------------------------------------------- one domain
def domain_fingerprint(spec: DomainSpec, teacher: Teacher, prompts: PromptRenderer) -> str:
    return fingerprint(VERSION, spec.to_dict(), teacher_fingerprint(teacher), prompts.model, prompts.template)


def check_pairing(spec: DomainSpec, teacher: Teacher) -> Query:
    """The query of `spec`, after checking that `teacher` can answer it (error names both)."""
    query = Query(spec.target, tuple(spec.classes) if spec.classes else None,
                  tuple(spec.labels) if spec.labels else None)
    try:
        teacher.check_query(query)
    except TeacherError as e:
        raise DomainError(f"domain {spec.name!r} (task {spec.task!r}, target {spec.target!r}): {e}") from None
    if spec.task == "classify" and teacher.labels and not set(teacher.labels) & set(spec.labels):
        raise DomainError(f"domain {spec.name!r}: teacher {teacher.name!r} answers {list(teacher.labels)}, "
                          f"none of which is in the domain's labels {spec.labels}")
    return query


def _label_answers(spec, teacher, query, items, cache, log, progress) -> None:
    todo = [it for it in items if _item_id(it) not in cache.records]
    done, start, last = len(items) - len(todo), time.monotonic(), 0.0
    for c in range(0, len(todo), CHUNK):
        chunk = todo[c:c + CHUNK]
        samples = [Sample(_item_id(it), it.kind, _rgb(it), it.truth, _qa(it)) for it in chunk]
        dets = (teacher.detect_batch([s.frame for s in samples]) if teacher.is_detector and spec.target != "direction"
                else [None] * len(samples))
        for it, s, d in zip(chunk, samples, dets):
            ans = teacher.answer(s, query, d)
            truth = truth_answer(s.truth, query, s.qa, s.id) if s.truth is not None else None
            cache.add({"id": s.id, "index": it.index, "answer": dump_answer(ans),
                       "truth": None if truth is None else dump_answer(truth)})
        done += len(chunk)
        if progress and (time.monotonic() - last > 0.5 or done == len(items)):
            last = time.monotonic()
            print(f"\rdistill {spec.name}: {done}/{len(items)} {spec.media}s labelled by {teacher.name} "
                  f"({time.monotonic() - start:.0f} s)", end="", file=log, flush=True)
    if progress and todo:
        print(file=log)


def _item_id(item: WorldItem) -> str:
    return f"{item.kind}-{item.index:06d}"


def _agreement(spec: DomainSpec, pairs: list[tuple[dict, dict]]) -> dict | None:
    """Teacher vs ground truth over the kept items: accuracy (F1 at IoU 0.5 for boxes)."""
    if not pairs:
        return None
    if spec.task == "detect":
        from heads.metrics import f1_at_iou

        pred = [[b for _, _, b, _ in (a["boxes"] or [])] for a, _ in pairs]
        true = [[b for _, _, b, _ in (t["boxes"] or [])] for _, t in pairs]
        return {"metric": "f1@0.5", "value": round(f1_at_iou(pred, true, 0.5), 4), "items": len(pairs)}
    if spec.task == "count":
        cap = spec.max_count
        hits = [min(a["count"], cap) == min(t["count"], cap) for a, t in pairs]
    else:
        hits = [a["label"] == t["label"] for a, t in pairs]
    return {"metric": "accuracy", "value": round(float(np.mean(hits)), 4), "items": len(pairs)}


def distill_domain(spec: DomainSpec, teacher: Teacher, world: WorldIndex, job: DistillJob,
                   prompts: PromptRenderer, log: TextIO | None = None) -> DistillResult:
    """Labels the domain's world items with `teacher` and writes `<datasets_dir>/<name>/`."""
    log, start = log or sys.stderr, time.perf_counter()
    out_dir = Path(job.datasets_dir) / spec.name
    query = check_pairing(spec, teacher)
    fp = domain_fingerprint(spec, teacher, prompts)
    if not job.overwrite and (out_dir / DOMAIN_FILE).is_file():
        meta = read_domain(out_dir)
        if meta.get("fingerprint") == fp:
            print(f"distill {spec.name}: kept {out_dir} (same config, teacher and model)", file=log, flush=True)
            return DistillResult(spec.name, out_dir, "kept", meta["sizes"], meta.get("teacher_vs_truth"), 0.0)
    items = (world.images if spec.media == "image" else world.clips)[:spec.size]
    if len(items) < spec.size:
        raise DomainError(f"domain {spec.name!r}: world {world.root} has {len(items)} {spec.media}s, needs {spec.size}")
    cache = AnswerCache(Path(job.datasets_dir) / ".work" / f"{spec.name}-{fp}.jsonl")
    try:
        _label_answers(spec, teacher, query, items, cache, log, job.progress)
    finally:
        cache.close()
    rows, pairs, dropped = {}, [], 0
    n_frames = world.config.clip_frames
    for it in items:
        rec = cache.records[_item_id(it)]
        ans = load_answer(rec["answer"])
        question = ans.question if spec.target == "qa" else spec.question
        if (spec.labels and ans.label not in spec.labels) or (spec.target == "qa" and not question):
            dropped += 1  # the teacher abstained ("none") or answered outside the label set
            continue
        fields = target_fields(spec.task, ans, world.config.width, world.config.height, spec.max_count, spec.max_boxes)
        clip = spec.media == "clip"
        rows[rec["id"]] = {
            "id": rec["id"], "domain": spec.name, "task": spec.task, "media": spec.media,
            "image": None if clip else {"bytes": it.path.read_bytes(), "path": None},
            "video": str(it.path.resolve()) if clip else "",
            "frames": evenly_spaced(n_frames, spec.frames_per_clip) if clip else [],
            "question": question, "prompt": prompts(question, spec.media), **fields, "teacher": teacher.name}
        if rec["truth"] is not None:
            pairs.append((rec["answer"], rec["truth"]))
    if len(rows) < 2:
        raise DomainError(f"domain {spec.name!r}: the teacher answered only {len(rows)} of {len(items)} items "
                          f"within the label set {spec.labels}")
    train_ids, eval_ids = split_ids(rows, spec.eval_fraction, spec.seed)
    splits = {"train": [rows[i] for i in sorted(train_ids)], "eval": [rows[i] for i in sorted(eval_ids)]}
    agreement = _agreement(spec, pairs)
    seconds = time.perf_counter() - start
    meta = {"name": spec.name, "task": spec.task, "labels": spec.labels, "max_count": spec.max_count,
            "max_boxes": spec.max_boxes, "teacher": teacher.describe(), "model": prompts.model, "media": spec.media,
            "sizes": {k: len(v) for k, v in splits.items()}, "created_by": CREATED_BY, "version": VERSION,
            "target": spec.target, "classes": spec.classes, "question": spec.question,
            "world": {"dir": str(world.root.resolve()), "config": world.config.to_dict()},
            "teacher_vs_truth": agreement, "dropped": dropped, "fingerprint": fp, "seconds": round(seconds, 1)}
    save_domain(out_dir, splits, meta)
    Path(cache.path).unlink(missing_ok=True)
    print(f"distill {spec.name}: wrote {out_dir} (train {meta['sizes']['train']}, eval {meta['sizes']['eval']}"
          + (f", {dropped} dropped" if dropped else "")
          + (f"; teacher vs truth {agreement['metric']} {agreement['value']:.3f}" if agreement else "")
          + f", {seconds:.1f} s)", file=log, flush=True)
    return DistillResult(spec.name, out_dir, "built", meta["sizes"], agreement, seconds)


# ----------------------------------------------------------------------------- many domains
def distill(specs: list[DomainSpec], settings: TeacherSettings, job: DistillJob,
            log: TextIO | None = None, teachers: dict[str, Teacher] | None = None) -> dict[str, DistillResult]:
    """Distils every domain; each teacher is built (trained if needed) once. `teachers` may hand
    in ready teacher objects by name (they take precedence over building by name)."""
    log = log or sys.stderr
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise DomainError(f"domain names must be unique, got {names}")
    built: dict[str, Teacher] = dict(teachers or {})
    for s in specs:  # fail on an unknown teacher or a bad pairing before any long work
        targets = None if s.teacher in built else teacher_targets(s.teacher, settings)
        if targets is not None and s.target not in targets:
            raise DomainError(f"domain {s.name!r} (task {s.task!r}, target {s.target!r}): teacher {s.teacher!r} "
                              f"cannot answer target {s.target!r}; it answers {sorted(targets)}")
    for s in specs:
        if s.teacher not in built:
            built[s.teacher] = build_teacher(s.teacher, settings, log)
        check_pairing(s, built[s.teacher])
    prompts = PromptRenderer(job)
    worlds = prepare_worlds(specs, job)
    return {s.name: distill_domain(s, built[s.teacher], worlds[s.name], job, prompts, log) for s in specs}


__all__ = ["DomainSpec", "DistillJob", "DistillResult", "DomainError", "PromptRenderer", "distill",
           "distill_domain", "prepare_worlds", "check_pairing", "load_distilled", "read_domain"]
