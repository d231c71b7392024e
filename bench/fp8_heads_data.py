"""The trained adapters and the world items the FP8 heads section (bench/fp8_heads.py) answers.

Either a directory the user names (`bench.fp8.adapters_dir`: a fusion manifest's folder, e.g. what
`vlora demo` leaves in `.vlora/adapters/fused/`, or one adapter directory with meta.json), or small
adapters trained here, one per domain of HEAD_DOMAINS: the world's frames distilled with the truth
teacher (train.distill with `teacher: truth`) and trained with train.train_adapter, as `vlora train`
does, only shorter. Items are each domain's eval split (held out from training): the prompt the head
was trained on, its picture (or a clip's frames), and the dataset's answer, which is the world's
truth where the teacher was the truth (`truth_from` names the teacher otherwise).

    adapters = trained_adapters(job, workdir)        # or adapters_from_dir(job.adapters_dir)
    items = eval_items(adapters[0].domains["count_vehicles"], 8)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# domain -> DomainSpec fields (as conf/dataset/<name>.yaml), labelled by the world's truth: one head of
# each type that is cheap to make (the default list); direction, on clips, costs rendering and is asked for by name
HEAD_DOMAINS = {
    "exists_bus": dict(task="binary", target="exists", classes=["bus"], question="Is there a bus?"),
    "count_vehicles": dict(task="count", target="count", classes=["car", "bus", "truck"],
                           question="How many vehicles are there?", max_count=6),
    "class_main": dict(task="classify", target="class", question="What kind of object is the largest one?",
                       world={"min_objects": 1}),
    "detect_car": dict(task="detect", target="boxes", classes=["car"], question="Where are the cars?", max_boxes=6),
    # clips of one second (conf/dataset/direction.yaml): four frames each through the engine's video input
    "direction": dict(task="classify", target="direction", media="clip",
                      question="Which way is the largest moving object going?", world={"clip_frames": 16, "fps": 15}),
}
HEAD_TASKS = ("binary", "classify", "count", "detect")  # lm domains have no head: they answer in text


@dataclass
class HeadAdapter:
    name: str
    path: Path
    base: Path  # the checkpoint the adapter was trained on
    rank: int
    targets: tuple[str, ...]
    domains: dict[str, dict]  # domain -> meta.json record (task, labels, media, question, teacher, dataset)


@dataclass
class HeadItem:
    id: str
    prompt: str  # the training prompt: chat template with the picture's placeholder
    image: object  # PIL image (media image) or None
    video: np.ndarray | None  # uint8 [T, H, W, 3] (media clip) or None
    truth: dict  # label / count / boxes of the dataset row


def check_heads_options(job) -> None:
    """Raises ValueError (one line, naming the option) before any model, world or engine is built."""
    for name, least in (("heads_items", 1), ("heads_train_items", 4), ("heads_epochs", 1), ("heads_captions", 0),
                        ("heads_caption_tokens", 1), ("heads_image_size", 64)):
        v = getattr(job, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"bench.fp8.{name}={v!r}: must be an int >= {least}")
    if job.heads_image_size % 2:
        raise ValueError(f"bench.fp8.heads_image_size={job.heads_image_size}: must be even (the world's frames)")
    if job.adapters_dir is not None:
        adapters_from_dir(job.adapters_dir)  # reads only meta.json / manifest.json
        return
    bad = [d for d in job.heads_domains if d not in HEAD_DOMAINS]
    if bad or not job.heads_domains:
        raise ValueError(f"bench.fp8.heads_domains={list(job.heads_domains)}: each must be one of "
                         f"{list(HEAD_DOMAINS)} (or set bench.fp8.adapters_dir to adapters of your own)")


def _adapter(path: Path) -> HeadAdapter:
    from adapters.meta import read_meta

    meta = read_meta(path)
    base = (meta.get("base_model") or {}).get("path")
    if not base or not Path(base).is_dir():
        raise ValueError(f"bench.fp8.adapters_dir: adapter {path} records no base checkpoint that exists here "
                         f"(meta.json base_model.path={base!r})")
    domains = {d: r for d, r in meta["domains"].items() if r.get("head") and r.get("task") in HEAD_TASKS}
    lora = meta.get("lora") or {}
    return HeadAdapter(path.name, path, Path(base), int(lora.get("rank", 16)),
                       tuple(lora.get("target_modules") or ()), domains)


def adapters_from_dir(directory: str | os.PathLike) -> list[HeadAdapter]:
    """The adapters with task heads under a fusion manifest's folder, or the one adapter directory."""
    from adapters.manifest import ManifestError, read_manifest

    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ValueError(f"bench.fp8.adapters_dir={str(directory)!r} is not a directory")
    if (root / "meta.json").is_file():
        found = [_adapter(root)]
    else:
        try:
            found = [_adapter(Path(a["path"])) for a in read_manifest(root)["adapters"]]
        except ManifestError as e:
            raise ValueError(f"bench.fp8.adapters_dir={str(directory)!r}: neither an adapter (meta.json) nor a "
                             f"fusion manifest's folder ({e})") from None
    found = [a for a in found if a.domains]
    if not found:
        raise ValueError(f"bench.fp8.adapters_dir={str(directory)!r}: no adapter there has a task head")
    if len({a.base.resolve() for a in found}) > 1:
        raise ValueError(f"bench.fp8.adapters_dir={str(directory)!r}: adapters of different base checkpoints "
                         f"{sorted({str(a.base) for a in found})}")
    return found


def trained_adapters(job, workdir: Path, log) -> list[HeadAdapter]:
    """One adapter per domain of job.heads_domains on job.heads_model (random zoo weights), trained here."""
    from train import (AdapterState, HeadState, LoraSpec, ModelRef, TrainConfig, VisionLM, load_domain, save_adapter,
                       train_adapter)
    from train.distill import DistillJob, DomainSpec, distill
    from train.fusion_trainer import domain_record
    from train.teachers import LabelsTeacher, TeacherSettings
    from zoo import build_checkpoint

    ckpt = build_checkpoint(job.heads_model, workdir / "zoo" / job.heads_model)
    size = {"width": job.heads_image_size, "height": job.heads_image_size}
    n_eval = job.heads_items
    specs = [DomainSpec(name=d, teacher="truth", size=job.heads_train_items + n_eval,
                        eval_fraction=n_eval / (job.heads_train_items + n_eval), seed=job.seed,
                        **{**HEAD_DOMAINS[d], "world": {**HEAD_DOMAINS[d].get("world", {}), **size}})
             for d in job.heads_domains]
    distill(specs, TeacherSettings(dir=str(workdir / "teachers")),
            DistillJob(datasets_dir=str(workdir / "datasets"), world_dir=str(workdir / "world"), model=job.heads_model,
                       model_path=str(ckpt), progress=False), log=log, teachers={"truth": LabelsTeacher()})
    cuda = job.device.startswith("cuda")
    vlm = VisionLM(ModelRef(job.heads_model, str(ckpt)), LoraSpec(rank=8, alpha=16, dropout=0.0), device=job.device,
                   mixed_precision="bf16" if cuda else "no", seed=job.seed)
    out = []
    for i, d in enumerate(job.heads_domains):
        data = load_domain(workdir / "datasets" / d)
        vlm.reset_lora(job.seed * 1000 + i)
        cfg = TrainConfig(epochs=job.heads_epochs, batch_size=32 if cuda else 4, lr=3e-3, head_lr=3e-2,
                          warmup_ratio=0.0, seed=job.seed)
        with open(os.devnull, "w") as quiet:  # per-step lines: one line per adapter below instead
            result = train_adapter(vlm, data, cfg, evaluate_at_end=False, log=quiet)
        state = AdapterState(result.lora, {d: HeadState.of(result.head)}, {d: domain_record(data, result.steps)})
        out.append(_adapter(save_adapter(vlm, state, workdir / "adapters" / d)))
        print(f"fp8 heads: trained {d} ({result.steps} steps, {result.seconds:.1f} s)", file=log, flush=True)
    del vlm
    return out


def _frames(row: dict) -> np.ndarray:
    from world.io import read_video

    frames = read_video(row["video"])  # BGR, as OpenCV reads it
    return np.stack([np.ascontiguousarray(frames[i][..., ::-1]) for i in row["frames"]])


def eval_items(record: dict, n: int) -> list[HeadItem]:
    """The first n items of the domain's eval split (the dataset meta.json records)."""
    from train import load_domain

    data = load_domain(record["dataset"])
    split = data.splits["eval"]
    items = []
    for i in range(min(n, len(split))):
        row = split[i]
        clip = row["media"] == "clip"
        items.append(HeadItem(row["id"], row["prompt"], None if clip else row["image"].convert("RGB"),
                              _frames(row) if clip else None,
                              {"label": row["label"], "count": row["count"], "boxes": row["boxes"]}))
    return items


def truth_from(record: dict) -> str:
    """Where a domain's answers come from: "world truth" for the truth teacher, else the teacher's name."""
    teacher = record.get("teacher") or {}
    name = teacher.get("name") if isinstance(teacher, dict) else str(teacher)
    kind = teacher.get("kind") if isinstance(teacher, dict) else None
    return "world truth" if kind == "labels" and name in ("truth", "ground_truth") else f"teacher {name}"
