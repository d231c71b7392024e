"""`vlora train`: one LoRA adapter plus the head of one domain; writes the adapter directory.

    vlora train dataset=color_main                      # ${paths.datasets}/color_main -> ${paths.adapters}/color_main
    vlora train train.dataset_dir=/data/plates train.out_dir=adapters/plates model.path=/ckpt train.base=model
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from train import (AdapterState, HeadState, LoraSpec, ModelRef, PretrainConfig, TrainConfig, VisionLM,
                   load_domain, pretrained_ref, save_adapter, train_adapter)
from train.checkpoint import checkpoint_path
from train.fusion_trainer import domain_record
from train.trainer import head_config_for

from ..config import to_dataclass
from .table import format_table

BASES = ("pretrained", "model")


@dataclass
class TrainJob:
    dataset_dir: str
    out_dir: str
    base: str = "pretrained"
    pretrained_dir: str | None = None
    resume: bool = True
    train_vision_tower: bool = False
    mixed_precision: str = "no"
    device: str | None = None
    gradient_checkpointing: bool = False
    pretrain: dict | None = None  # conf/pretrain.yaml `pretrain:` keys for base=pretrained (None: its defaults)
    allow_random_base: bool = False  # base=model on a zoo checkpoint with random weights (refused otherwise)
    zero_shot_baseline: bool = True  # the base model's own answers to the eval items beside the score

    def __post_init__(self) -> None:
        if self.base not in BASES:
            raise ValueError(f"train.base={self.base!r}: must be one of {list(BASES)}")


def split_train_node(node: DictConfig) -> tuple[TrainJob, TrainConfig]:
    values = OmegaConf.to_container(node, resolve=True)
    own = {f.name for f in dataclasses.fields(TrainJob)}
    job = to_dataclass(TrainJob, {k: v for k, v in values.items() if k in own})
    return job, to_dataclass(TrainConfig, {k: v for k, v in values.items() if k not in own})


def ensure_zoo_model(cfg: DictConfig) -> Path:
    """model.path, built first when it names a missing zoo model."""
    from zoo import SPECS, build_checkpoint

    path = Path(cfg.model.path)
    if not (path / "config.json").is_file() and cfg.model.name in SPECS:
        build_checkpoint(cfg.model.name, path, seed=cfg.seed)
    return path


def refuse_random_base(cfg: DictConfig, job: TrainJob) -> None:
    """Ends the run with one line when train.base=model names a checkpoint with random weights (a
    zoo build, or a copy of one: its zoo.json says so), before anything is built or loaded. An
    adapter trained on one scores like noise (0.195 against 0.716 on the world-pretrained tiny
    base, on one classification domain) and nothing else would say why."""
    from zoo import SPECS, random_weights

    if job.base != "model" or job.allow_random_base:
        return
    path = Path(cfg.model.path)
    record = random_weights(path)
    if record is not None:
        what = f"model.path {path} holds zoo model {record.get('name')!r} with random weights (its zoo.json says so)"
    elif not (path / "config.json").is_file() and cfg.model.name in SPECS:
        what = f"model.path {path} is missing and would be built as zoo model {cfg.model.name!r} with random weights"
    else:
        return  # a checkpoint from elsewhere: trained, as far as anything here knows
    raise SystemExit(f"train.base=model refused: {what}, so an adapter trained on it answers noise; train on "
                     "its world pretraining instead (train.base=pretrained: built when missing, or ahead by "
                     "`vlora pretrain` with the same model overrides), or pass train.allow_random_base=true "
                     "to train on the random weights anyway")


def model_ref(cfg: DictConfig, job: TrainJob, log=None) -> ModelRef:
    """The checkpoint to train on: model.path, or its world pretraining (built when missing)."""
    refuse_random_base(cfg, job)
    ensure_zoo_model(cfg)
    ref = to_dataclass(ModelRef, cfg.model)
    if job.base == "pretrained":
        try:  # a larger model needs a longer pretraining than the tiny one's default
            settings = to_dataclass(PretrainConfig, {"seed": cfg.seed, **(job.pretrain or {})})
        except ValueError as e:
            raise ValueError(f"train.pretrain: {e}") from None
        ref = pretrained_ref(ref, job.pretrained_dir, settings, log=log)
    return ref


# a domain's task -> the kind of answer the apps read from generated text (apps/common/answers.py)
ANSWER_KIND = {"count": "count", "binary": "yes_no", "classify": "label", "detect": "detect", "lm": "text"}


def served_answer(info, text: str):
    """Generated text read as the apps read a served answer, in the head's target form (a count,
    "yes"/"no", a label, unit boxes, the text for lm); None where it holds no answer."""
    from apps.common.answers import from_text

    pred = from_text(ANSWER_KIND[info.task], text, 1, 1, labels=info.labels or ())  # 1 x 1: boxes in units
    if info.task == "detect":
        return [list(b) for b in pred.boxes] if pred.parsed else None
    return pred.value() if pred.parsed else None


def zero_shot_baseline(job: TrainJob, log=None):
    """The base model's zero-shot baseline (train/zero_shot.py) where train.zero_shot_baseline is on."""
    from train.zero_shot import ZeroShot

    return ZeroShot(served_answer, log=log) if job.zero_shot_baseline else None


def head_options(cfg: DictConfig, task: str) -> dict:
    head = OmegaConf.to_container(cfg.head, resolve=True) if cfg.get("head") is not None else {}
    if head and head.get("type") != task:
        raise ValueError(f"head={head.get('type')!r} does not fit the dataset's task {task!r}; "
                         f"leave the head out or pass head={task}")
    return {k: v for k, v in head.items() if k != "type"}


def score_lines(name: str, task: str, metrics: dict, steps: int, seconds: float) -> list[str]:
    """The eval score's table with its baselines beside it (train/baselines.py: always answering the
    most common training label; the base model zero-shot; the teacher against the truth), and a
    line flagging an adapter no better than either of the first two."""
    from train.baselines import (baseline_cell, baseline_line, beats_cell, teacher_cell, zero_shot_cell,
                                 zero_shot_line)

    verdict = metrics.get("baseline")
    shot = (metrics.get("baselines") or {}).get("zero_shot")
    row = {"domain": name, "task": task, "metric": metrics["metric"], "accuracy": round(metrics["accuracy"], 3),
           "majority": baseline_cell(verdict) or "-", "beats_majority": beats_cell(verdict) or "- (no share of items)",
           "zero_shot": zero_shot_cell(metrics), "beats_zero_shot": beats_cell(shot) or "-",
           "teacher_vs_truth": teacher_cell(metrics), "eval_items": metrics["n"], "steps": steps,
           "seconds": round(seconds, 1)}
    flags = [line for line in (baseline_line(name, metrics), zero_shot_line(name, metrics)) if line]
    return [format_table([row])] + ([""] + flags if flags else [])


def run(cfg: DictConfig) -> dict:
    job, tcfg = split_train_node(cfg.train)
    tcfg.seed = cfg.seed
    start = time.perf_counter()
    data = load_domain(job.dataset_dir)
    options = head_options(cfg, data.info.task)
    ref = model_ref(cfg, job, log=sys.stderr)
    lora = to_dataclass(LoraSpec, cfg.adapter)
    vlm = VisionLM(ref, lora, job.train_vision_tower, job.mixed_precision, job.device, seed=cfg.seed,
                   gradient_checkpointing=job.gradient_checkpointing)
    head = None
    if data.info.task != "lm":
        from heads import build_head

        head = build_head(head_config_for(data.info, vlm.hidden_size, options))
    result = train_adapter(vlm, data, tcfg, head=head, checkpoint_dir=job.out_dir, resume=job.resume,
                           zero_shot=zero_shot_baseline(job, sys.stderr))
    name = data.name
    heads = {name: HeadState.of(result.head)} if result.head is not None else {}
    state = AdapterState(result.lora, heads, {name: domain_record(data, result.steps)}, {name: result.metrics})
    out = save_adapter(vlm, state, job.out_dir, extra_meta={"train": dataclasses.asdict(tcfg)})
    shutil.rmtree(checkpoint_path(out), ignore_errors=True)  # the run is complete: nothing to resume
    seconds = time.perf_counter() - start
    print(f"\nAdapter {out} (base {ref.name})\n")
    print("\n".join(score_lines(name, data.info.task, result.metrics, result.steps, seconds)))
    return {"adapter": str(out), "metrics": {name: result.metrics}, "seconds": seconds}
