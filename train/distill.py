"""The distiller: one teacher over representative frames or clips -> one dataset per domain.

    specs = [DomainSpec(name="count_vehicles", task="count", target="count", teacher="yolo_world",
                        classes=["car", "bus", "truck"], question="How many vehicles are there?")]
    results = distill(specs, TeacherSettings(dir=".vlora/teachers"),
                      DistillJob(datasets_dir=".vlora/datasets", world_dir=".vlora/world"))
    dd, meta = load_distilled(".vlora/datasets/count_vehicles")      # DatasetDict + domain.json

Frames come from the domain's source (distill_sources): by default a world written with
`world.write_world` (PNG images; clips as real .mp4 files that the dataset references by path);
or a user's recording, cut into chunks as the video app sends them and written as small clip
files (distill_video; split by time: eval is the recording's final stretch); or a user's images,
labelled by the teacher or read as truth (image folders per class, COCO, YOLO, a saved Hugging
Face dataset; teacher `labels`). Prompts are the question in the chat format of the
configured model, rendered by its own processor (the zoo builds the checkpoint if missing).
Resumable at two levels: a finished domain whose fingerprint (spec, teacher weights, a plug-in's
code and checkpoints, model, chat template: distill_key) matches is kept as is, and one that
does not is rebuilt with a line saying what changed; an interrupted one resumes from its cached
teacher answers (`<datasets_dir>/.work/<domain>-<fingerprint>.jsonl`); the fingerprint of a
source other than the world also covers its files. Besides the contract's fields, domain.json
records the source (the world, or kind / path / fps / frame count / chunking of a recording), the
split, the cache key's parts, and how often the teacher agrees with the ground truth (of the
world or of labelled data) on the items.
"""
from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from world.progress import ProgressLine

from .distill_augment import augmented_media, combinations, copy_id, transform_answer
from .distill_io import (CREATED_BY, DOMAIN_FILE, AnswerCache, dump_answer, evenly_spaced, load_answer,
                         load_distilled, read_domain, save_domain, split_ids, target_fields)
from .distill_key import FileHashes, domain_key, matches, rebuild_reasons, record_key
from .distill_prompts import PromptRenderer
from .distill_sources import ImageSource, SourceError, pick
from .distill_spec import VERSION, DistillJob, DomainError, DomainSpec
from .distill_video import VideoSource, time_split
from .distill_world import WorldSource, prepare_worlds
from .teachers import (LabelsTeacher, Query, Teacher, TeacherError, TeacherSettings, build_teacher,
                       teacher_targets, truth_answer)

CHUNK = 32  # items per teacher call (YOLO predicts a chunk as one batch)


@dataclass
class DistillResult:
    name: str
    path: Path
    status: str            # "built" | "kept"
    sizes: dict[str, int]
    agreement: dict | None  # teacher vs ground truth on the domain's items
    seconds: float


# ----------------------------------------------------------------------------- one domain
def open_source(spec: DomainSpec) -> VideoSource | ImageSource:
    """The source of a domain that does not come from the world: read its listing, annotations or
    video header now (cheap), so a bad path or format fails before any long work."""
    src = spec.source_spec()
    try:
        return VideoSource(src, f"domain {spec.name!r}") if src.kind == "video" else ImageSource(src, f"domain {spec.name!r}")
    except SourceError as e:
        raise DomainError(str(e)) from None


def check_pairing(spec: DomainSpec, teacher: Teacher, source=None) -> Query:
    """The query of `spec`, after checking that `teacher` can answer it on `source` (errors name both)."""
    where = f"domain {spec.name!r} (task {spec.task!r}, target {spec.target!r})"
    query = Query(spec.target, tuple(spec.classes) if spec.classes else None,
                  tuple(spec.labels) if spec.labels else None)
    try:
        teacher.check_query(query)
    except TeacherError as e:
        raise DomainError(f"{where}: {e}") from None
    labels = spec.labels or getattr(source, "labels", None)
    if spec.task == "classify" and teacher.labels and labels and not set(teacher.labels) & set(labels):
        raise DomainError(f"domain {spec.name!r}: teacher {teacher.name!r} answers {list(teacher.labels)}, "
                          f"none of which is in the domain's labels {labels}")
    if isinstance(teacher, LabelsTeacher) and source is not None and not spec.from_world:
        if not spec.source_spec().labelled:
            raise DomainError(f"{where}: teacher {teacher.name!r} reads labels, but a {spec.source['kind']!r} source "
                              f"has none; use a labelled source (image_folder, coco, yolo, hf) or a model as teacher")
        answers = {"image_folder": ("class", "color", "count", "exists"), "hf": ("class", "color", "count", "exists"),
                   "coco": ("count", "boxes", "exists", "class"), "yolo": ("count", "boxes", "exists", "class")}
        kind = spec.source["kind"]
        if spec.target not in answers[kind]:
            raise DomainError(f"{where}: {kind} labels answer targets {list(answers[kind])}, not {spec.target!r}")
        known = source.classes
        if spec.classes and known is not None and not set(spec.classes) <= set(known):
            raise DomainError(f"{where}: classes {spec.classes} are not all in the labelled data's classes {list(known)}")
    return query


def _label_answers(spec, teacher, query, items, source, cache, log, progress, workers: int = 1) -> None:
    todo = [it for it in items if it.id not in cache.records]
    done, start, last, bar = len(items) - len(todo), time.monotonic(), 0.0, ProgressLine(log)
    pool = ThreadPoolExecutor(workers) if workers > 1 and todo else None

    def flush(samples):
        nonlocal done, last
        dets = (teacher.detect_batch([s.frame for s in samples]) if teacher.is_detector and spec.target != "direction"
                else [None] * len(samples))
        answers = (pool.map if pool is not None else map)(teacher.answer, samples, [query] * len(samples), dets)
        for s, ans in zip(samples, answers):  # in item order: the cache is the same either way
            truth = truth_answer(s.truth, query, s.qa, s.id) if s.truth is not None else None
            h, w = s.frame.shape[:2]
            cache.add({"id": s.id, "answer": dump_answer(ans), "size": [w, h],
                       "truth": None if truth is None else dump_answer(truth)})
        done += len(samples)
        if progress and (time.monotonic() - last > 0.5 or done == len(items)):
            last = time.monotonic()
            bar.update(f"distill {spec.name}: {done}/{len(items)} {spec.media}s labelled by {teacher.name} "
                       f"({time.monotonic() - start:.0f} s)")

    batch = []
    try:
        for sample in source.samples(todo):
            batch.append(sample)
            if len(batch) == CHUNK:
                flush(batch)
                batch = []
        if batch:
            flush(batch)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    if progress and todo:
        bar.end()


def _resolved(spec: DomainSpec, teacher: Teacher, source, answers: list[Any]) -> tuple[list | None, int | None, int | None]:
    """(labels, max_count, max_boxes) of the domain: as configured, else (for a source other than
    the world) from the teacher's or the labelled data's declared labels, or from the answers."""
    labels, max_count, max_boxes = spec.labels, spec.max_count, spec.max_boxes
    if spec.task == "classify" and labels is None:
        declared = getattr(source, "labels", None) or (getattr(source, "classes", None) if spec.target == "class" else None)
        labels = list(teacher.labels or declared or [])
        if not labels:
            labels = sorted({a.label for a in answers if a.label and a.label != "none"})
        if len(labels) < 2:
            raise DomainError(f"domain {spec.name!r}: a classify domain needs >= 2 labels; the teacher declares none "
                              f"and answered {labels}; set labels: [...] in the domain")
    if spec.task == "count" and max_count is None:
        max_count = max([1] + [int(a.count) for a in answers if a.count is not None])
    if spec.task == "detect" and max_boxes is None:
        max_boxes = max([1] + [len(a.boxes or ()) for a in answers])
    return labels, max_count, max_boxes


def _agreement(spec: DomainSpec, pairs: list[tuple[dict, dict]], cap: int | None) -> dict | None:
    """Teacher vs ground truth over the kept items: accuracy (F1 at IoU 0.5 for boxes)."""
    if not pairs:
        return None
    if spec.task == "detect":
        from heads.metrics import f1_at_iou

        pred = [[b for _, _, b, _ in (a["boxes"] or [])] for a, _ in pairs]
        true = [[b for _, _, b, _ in (t["boxes"] or [])] for _, t in pairs]
        return {"metric": "f1@0.5", "value": round(f1_at_iou(pred, true, 0.5), 4), "items": len(pairs)}
    if spec.task == "count":
        hits = [min(a["count"], cap) == min(t["count"], cap) for a, t in pairs]
    else:
        hits = [a["label"] == t["label"] for a, t in pairs]
    return {"metric": "accuracy", "value": round(float(np.mean(hits)), 4), "items": len(pairs)}


def distill_domain(spec: DomainSpec, teacher: Teacher, source, job: DistillJob,
                   prompts: PromptRenderer, log: TextIO | None = None) -> DistillResult:
    """Labels the domain's items of `source` (a WorldSource, VideoSource or ImageSource) with
    `teacher` and writes `<datasets_dir>/<name>/`."""
    log, start = log or sys.stderr, time.perf_counter()
    out_dir = Path(job.datasets_dir) / spec.name
    query = check_pairing(spec, teacher, source)
    hashes = FileHashes(Path(job.datasets_dir) / ".work" / "file-hashes.json")  # checkpoints hashed once
    key = domain_key(spec, teacher, prompts, source, hashes)
    hashes.save()
    fp = key.fingerprint
    if (out_dir / DOMAIN_FILE).is_file():
        meta = read_domain(out_dir)
        if job.overwrite:
            print(f"distill {spec.name}: rebuilding {out_dir}: distill.overwrite is set", file=log, flush=True)
        elif matches(meta, key):
            record_key(out_dir, meta, key)
            print(f"distill {spec.name}: kept {out_dir} (same config, data, teacher and model)", file=log, flush=True)
            return DistillResult(spec.name, out_dir, "kept", meta["sizes"], meta.get("teacher_vs_truth"), 0.0)
        else:
            print(f"distill {spec.name}: rebuilding {out_dir}: {'; '.join(rebuild_reasons(meta, key))}",
                  file=log, flush=True)
    if isinstance(source, VideoSource):
        try:
            source.prepare(job.world_dir, log, job.progress)
        except SourceError as e:
            raise DomainError(str(e)) from None
    items = source.items if spec.from_world else pick(source.items, spec.size)
    cache = AnswerCache(Path(job.datasets_dir) / ".work" / f"{spec.name}-{fp}.jsonl")
    try:
        _label_answers(spec, teacher, query, items, source, cache, log, job.progress, job.label_workers)
    finally:
        cache.close()
    records = [cache.records[it.id] for it in items]
    answers = [load_answer(r["answer"]) for r in records]
    labels, max_count, max_boxes = _resolved(spec, teacher, source, answers)
    rows, pairs, dropped, kept = {}, [], 0, {}
    clip_frames = getattr(getattr(source, "spec", None), "frames_per_chunk", None) or spec.frames_per_clip
    for it, rec, ans in zip(items, records, answers):
        question = ans.question if spec.target == "qa" else spec.question
        if (labels and ans.label not in labels) or (spec.target == "qa" and not question):
            dropped += 1  # the teacher abstained ("none") or answered outside the label set
            continue
        w, h = rec.get("size") or source.size
        fields = target_fields(spec.task, ans, w, h, max_count, max_boxes)
        clip = spec.media == "clip"
        if isinstance(source, VideoSource):
            clip_frames = source.spec.frames_per_chunk or it.n_frames  # the app sends every frame of a chunk
        rows[rec["id"]] = {
            "id": rec["id"], "domain": spec.name, "task": spec.task, "media": spec.media, **it.media_fields(),
            "frames": evenly_spaced(it.n_frames, clip_frames) if clip else [],
            "question": question, "prompt": prompts(question, spec.media), **fields, "teacher": teacher.name}
        kept[rec["id"]] = (ans, (w, h))
        if rec["truth"] is not None:
            pairs.append((rec["answer"], rec["truth"]))
    if len(rows) < 2:
        raise DomainError(f"domain {spec.name!r}: the teacher answered only {len(rows)} of {len(items)} items "
                          f"within the label set {labels}")
    if isinstance(source, VideoSource):
        train_ids, eval_ids, eval_from = time_split([it for it in items if it.id in rows], spec.eval_fraction)
        split = {"kind": "time", "eval": "the final stretch of the recording", "eval_from_s": eval_from}
    else:
        train_ids, eval_ids = split_ids(rows, spec.eval_fraction, spec.seed)
        split = {"kind": "random", "seed": spec.seed}
    splits = {"train": [rows[i] for i in sorted(train_ids)], "eval": [rows[i] for i in sorted(eval_ids)]}
    if spec.augment:  # copies of the training items only: eval stays what the teacher saw
        clip_dir = Path(job.world_dir) / f"augment-{spec.name}-{fp[:8]}"
        splits["train"] += _augmented(spec, splits["train"], kept, (max_count, max_boxes), clip_dir, log, job.progress)
    agreement = _agreement(spec, pairs, max_count)
    seconds = time.perf_counter() - start
    meta = {"name": spec.name, "task": spec.task, "labels": labels, "max_count": max_count,
            "max_boxes": max_boxes, "teacher": teacher.describe(), "model": prompts.model, "media": spec.media,
            "sizes": {k: len(v) for k, v in splits.items()}, "created_by": CREATED_BY, "version": VERSION,
            "target": spec.target, "classes": spec.classes, "question": spec.question,
            "source": source.record(), "split": split,
            "teacher_vs_truth": agreement, "dropped": dropped, "fingerprint": fp, "key": key.record,
            "seconds": round(seconds, 1)}
    if spec.augment:
        meta["augment"] = {"transforms": spec.augment, "items": len(train_ids),
                           "copies_per_item": len(combinations(spec.augment))}
    if spec.from_world:
        meta["world"] = {"dir": str(source.world.root.resolve()), "config": source.world.config.to_dict()}
    save_domain(out_dir, splits, meta)
    Path(cache.path).unlink(missing_ok=True)
    print(f"distill {spec.name}: wrote {out_dir} (train {meta['sizes']['train']}, eval {meta['sizes']['eval']}"
          + (f", {dropped} dropped" if dropped else "")
          + (f"; teacher vs truth {agreement['metric']} {agreement['value']:.3f}" if agreement else "")
          + f", {seconds:.1f} s)", file=log, flush=True)
    return DistillResult(spec.name, out_dir, "built", meta["sizes"], agreement, seconds)


def _augmented(spec: DomainSpec, train: list[dict], kept: dict, caps: tuple, clip_dir: Path, log: TextIO,
               progress: bool) -> list[dict]:
    """The mirrored / reversed copies of the training rows (distill_augment), labelled from the
    teacher's answers to the originals."""
    combos, out, start, bar = combinations(spec.augment), [], time.monotonic(), ProgressLine(log)
    for n, row in enumerate(train, 1):
        answer, (w, h) = kept[row["id"]]
        for combo in combos:
            copy = copy_id(row["id"], combo)
            fields = target_fields(spec.task, transform_answer(answer, combo, spec.target, w, h), w, h, *caps)
            out.append({**row, "id": copy, **augmented_media(row, combo, copy, clip_dir), **fields})
        if progress and (n % 64 == 0 or n == len(train)):
            bar.update(f"distill {spec.name}: {n}/{len(train)} training items copied x{len(combos)} "
                       f"({'+'.join(spec.augment)}, {time.monotonic() - start:.0f} s)")
    if progress and train:
        bar.end()
    return out


# ----------------------------------------------------------------------------- many domains
def teacher_key(spec: str | dict) -> str:
    """The key a teacher spec is built once under (a mapping's canonical JSON)."""
    return spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True, default=str)


def distill(specs: list[DomainSpec], settings: TeacherSettings, job: DistillJob,
            log: TextIO | None = None, teachers: dict[str, Teacher] | None = None) -> dict[str, DistillResult]:
    """Distils every domain; each teacher is built (trained if needed) once. `teachers` may hand
    in ready teacher objects by name (they take precedence over building by name). Unknown
    teachers, `_target_`s that do not import, teachers that cannot answer a domain's target and
    sources that cannot be read fail before any teacher is trained or any frame is written."""
    log = log or sys.stderr
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise DomainError(f"domain names must be unique, got {names}")
    built: dict[str, Teacher] = dict(teachers or {})
    sources: dict[str, Any] = {}
    for s in specs:  # fail on an unknown teacher or a bad pairing before any long work
        key = teacher_key(s.teacher)
        try:
            targets = None if key in built else teacher_targets(s.teacher, settings)
        except TeacherError as e:
            raise DomainError(f"domain {s.name!r}: {e}") from None
        if targets is not None and s.target not in targets:
            shown = s.teacher if isinstance(s.teacher, str) else s.teacher["_target_"]
            raise DomainError(f"domain {s.name!r} (task {s.task!r}, target {s.target!r}): teacher {shown!r} "
                              f"cannot answer target {s.target!r}; it answers {sorted(targets)}")
        if not s.from_world:
            sources[s.name] = open_source(s)
    for s in specs:
        key = teacher_key(s.teacher)
        if key not in built:
            try:
                built[key] = build_teacher(s.teacher, settings, log)
            except TeacherError as e:
                raise DomainError(f"domain {s.name!r}: {e}") from None
        check_pairing(s, built[key], sources.get(s.name))
    prompts = PromptRenderer(job)
    worlds = prepare_worlds([s for s in specs if s.from_world], job)
    for s in specs:
        if s.from_world:
            sources[s.name] = WorldSource(worlds[s.name], s)
    return {s.name: distill_domain(s, built[teacher_key(s.teacher)], sources[s.name], job, prompts, log)
            for s in specs}


__all__ = ["DomainSpec", "DistillJob", "DistillResult", "DomainError", "PromptRenderer", "distill",
           "distill_domain", "prepare_worlds", "check_pairing", "open_source", "teacher_key", "load_distilled",
           "read_domain"]
