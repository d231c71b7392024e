"""Make a random-weight zoo model learnable: a short full fine-tune on the synthetic world.

The zoo's tiny checkpoints have random weights; LoRA adapters plus heads on top of them stay at
chance on the world's tasks (the frozen random vision tower and language model carry too little
usable signal). `pretrain` fine-tunes every weight (vision tower, projector, language model) on
freshly rendered world scenes with conversations from their truth (`pretrain_data`), for a fixed
number of steps or a time budget, and saves a new Hugging Face checkpoint directory. The result
is cached: `pretrain.json` records the config and the base checkpoint, and a later call with the
same ones returns the directory as it is. Interrupted runs resume from `<out>.partial/`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from world import WorldConfig
from world.progress import ProgressLine

from .pretrain_data import collate_examples, encode_example, encode_pixels, sample_example
from .pretrain_losses import RegionProbe, conversation_losses, vision_loss
from .vision_attention import batch_vision_attention

RECORD = "pretrain.json"


@dataclass
class PretrainConfig:
    """conf/pretrain.yaml `pretrain:`."""

    steps: int = 500  # full steps: conversations + region captions through the whole model
    batch_size: int = 8
    vision_steps: int = 0  # first, steps on the vision tower alone (region captions of its features)
    vision_batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    # question/answer turns per item; they share one vision-tower pass. On the tiny model 6 lifted its
    # zero-shot qa from 0.44 to 0.54-0.59 for 220 s of pretraining instead of 155 s inside `vlora offline`
    # (results/offline/README.md, probes/qa_kinds.txt)
    turns: int = 6
    clip_fraction: float = 0.25  # share of batches that are clips (for models that take video)
    frames: int = 4  # frames per clip
    world_seed: int = 1_000_003  # scenes unlike the default worlds, so domain eval data is unseen
    seed: int = 0
    region_weight: float = 1.0  # weight of the region-caption loss beside the answer loss
    max_seconds: float | None = None  # stop early (and save) after this much training time
    save_every: int = 100  # steps between resumable checkpoints in <out>.partial/
    device: str | None = None  # null: cuda when available, else cpu
    mixed_precision: str = "no"  # "bf16": autocast the forward (fp32 weights and optimizer state)
    workers: int = 0  # processes that render and encode the next batches while the model trains

    # how the steps run, not what they compute: left out of the cache key
    RUNTIME = ("save_every", "device", "workers")

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "vision_batch_size", "turns", "frames", "save_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PretrainConfig.{name}={v!r}: must be an int >= 1")
        if not 0.0 <= self.clip_fraction <= 1.0:
            raise ValueError(f"PretrainConfig.clip_fraction={self.clip_fraction!r}: must be in [0, 1]")
        for name in ("vision_steps", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"PretrainConfig.{name}={v!r}: must be an int >= 0")
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"PretrainConfig.mixed_precision={self.mixed_precision!r}: must be 'no' or 'bf16'")
        if self.device is not None and not str(self.device).split(":")[0] in ("cpu", "cuda"):
            raise ValueError(f"PretrainConfig.device={self.device!r}: must be null, 'cpu' or 'cuda[:N]'")

    @property
    def total_steps(self) -> int:
        return self.vision_steps + self.steps

    def phase(self, step: int) -> tuple[bool, int, int]:
        """(vision only?, batch size, index of the batch's first item in the scene stream) of a step."""
        v = self.vision_steps
        if step < v:
            return True, self.vision_batch_size, step * self.vision_batch_size
        return False, self.batch_size, v * self.vision_batch_size + (step - v) * self.batch_size

    def lr_factor(self, step: int) -> float:
        """Warm-up, then cosine decay to 10%, within each phase."""
        local, length = (step, self.vision_steps) if step < self.vision_steps else \
            (step - self.vision_steps, self.steps)
        warm = min(1.0, (local + 1) / max(1, self.warmup_steps))
        return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, local / max(1, length)))))

    def key(self) -> dict:
        """What determines the result (max_seconds does too, but only through the steps it allows).
        Full precision is left out, so records written before mixed precision existed still match."""
        key = {k: v for k, v in dataclasses.asdict(self).items() if k not in self.RUNTIME}
        if key["mixed_precision"] == "no":
            del key["mixed_precision"]
        return key

    def resolved_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class _Batches(torch.utils.data.Dataset):
    """Step -> that step's collated batch. Every example is drawn from its index alone, so a batch
    is the same whether it is built here or in a loader worker, and a resumed run sees the batches
    it would have seen."""

    def __init__(self, cfg: PretrainConfig, world: WorldConfig, processor, video_ok: bool, placeholder_ids, pad_id):
        self.cfg, self.world, self.processor = cfg, world, processor
        self.video_ok, self.placeholder_ids, self.pad_id = video_ok, placeholder_ids, pad_id

    def __len__(self) -> int:
        return self.cfg.total_steps

    def __getitem__(self, step: int) -> tuple[bool, dict]:
        cfg, world = self.cfg, self.world
        vision_only, size, first = cfg.phase(step)
        video = self.video_ok and (step * 0.6180339887) % 1.0 < cfg.clip_fraction  # a fixed, even mix of batches
        examples = [sample_example(world, first + j, video, cfg.turns, cfg.frames, cfg.seed) for j in range(size)]
        if vision_only:
            encoded = [encode_pixels(self.processor, ex, world.classes, world.colors) for ex in examples]
        else:
            encoded = [encode_example(self.processor, ex, world.classes, world.colors, self.placeholder_ids)
                       for ex in examples]
        batch = collate_examples(encoded, self.pad_id)
        if cfg.mixed_precision == "bf16":  # autocast would cast them anyway; half the bytes to move
            for key in ("pixel_values", "pixel_values_videos"):
                if key in batch:
                    batch[key] = batch[key].to(torch.bfloat16)
        return vision_only, batch


def _batches(data: _Batches, start: int, workers: int):
    """The batches of steps start.. in order; with workers, built ahead in other processes.
    Not pinned: one H100 probe with pinned memory measured 195 ms a batch, against 127-137 ms
    unpinned on two other hosts (not yet compared on one host)."""
    if workers == 0:
        return (data[i] for i in range(start, len(data)))
    workers = min(workers, max(1, (os.cpu_count() or 2) - 1))  # one core stays with the training loop
    return iter(torch.utils.data.DataLoader(data, batch_size=None, sampler=range(start, len(data)),
                                            num_workers=workers, prefetch_factor=2, persistent_workers=False))


def _base_digest(base: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        if (base / name).is_file():
            h.update((base / name).read_bytes())
    return h.hexdigest()[:16]


def cached_pretrained(base: str | Path, out: str | Path, cfg: PretrainConfig) -> Path | None:
    """`out` when it holds a finished pretraining of `base` under `cfg`, else None."""
    record = Path(out) / RECORD
    if not record.is_file():
        return None
    rec = json.loads(record.read_text())
    ok = rec.get("config") == json.loads(json.dumps(cfg.key())) and rec.get("base_digest") == _base_digest(Path(base))
    return Path(out) if ok else None


def pretrained_dir_for(base: str | Path, out: str | Path, cfg: PretrainConfig) -> Path:
    """Where the pretraining of `base` under `cfg` goes: `out`, unless `out` already holds a
    finished pretraining of another base or config. That one stays where it is (adapters trained
    on it name its path in their meta.json, and replacing it would silently change what they
    run on); this one goes beside it, named by its config and base, where a later run with the
    same settings finds it again."""
    out = Path(out)
    if not (out / RECORD).is_file() or cached_pretrained(base, out, cfg) is not None:
        return out
    key = json.dumps({"config": cfg.key(), "base_digest": _base_digest(Path(base))}, sort_keys=True)
    return out.with_name(f"{out.name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}")


def _differences(out: Path, base: Path, cfg: PretrainConfig) -> str:
    """What differs between `out`'s record and this run, for the log: settings, or the base."""
    rec = json.loads((out / RECORD).read_text())
    theirs, ours = rec.get("config") or {}, json.loads(json.dumps(cfg.key()))
    changed = [f"{k} {ours.get(k)!r} (there {theirs.get(k)!r})" for k in sorted(set(theirs) | set(ours))
               if theirs.get(k) != ours.get(k)]
    if rec.get("base_digest") != _base_digest(base):
        changed.append("another base checkpoint")
    return ", ".join(changed) or "same settings"


def pretrain(base: str | Path, out: str | Path, cfg: PretrainConfig, log=None, force: bool = False) -> Path:
    """Full fine-tune of the checkpoint at `base` on the synthetic world; writes checkpoint `out`
    (or a sibling of it, `pretrained_dir_for`) and returns its path."""
    from zoo import load_pretrained

    log = log or sys.stderr
    base, asked = Path(base), Path(out)
    out = pretrained_dir_for(base, asked, cfg)
    if out != asked:
        print(f"[pretrain] {asked} holds a pretraining with other settings or another base; it stays, "
              f"and this one ({_differences(asked, base, cfg)}) is {out}", file=log, flush=True)
    if not force and cached_pretrained(base, out, cfg) is not None:
        print(f"[pretrain] kept {out} (same base and config)", file=log, flush=True)
        return out
    device = cfg.resolved_device()
    model, processor = load_pretrained(base, dtype="float32", device=str(device))
    batch_vision_attention(model)  # one attention launch per vision layer, not one per picture
    video_ok = getattr(processor, "video_processor", None) is not None and "llava" not in model.config.model_type
    pad_id = processor.tokenizer.pad_token_id or 0
    world = WorldConfig(seed=cfg.world_seed)
    c = model.config
    placeholder_ids = [i for i in (getattr(c, "image_token_id", None), getattr(c, "image_token_index", None),
                                   getattr(c, "video_token_id", None)) if i is not None]
    torch.manual_seed(cfg.seed)
    width = c.get_text_config().hidden_size
    probe = torch.nn.ModuleList([RegionProbe(width, len(world.classes), len(world.colors)) for _ in range(2)]).to(device)
    model.requires_grad_(True).train()
    params = list(model.parameters()) + list(probe.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cfg.lr_factor)
    partial = out.with_name(out.name + ".partial")
    step, losses, elapsed = 0, [], 0.0
    if (partial / "state.pt").is_file() and not force:
        state = torch.load(partial / "state.pt", map_location="cpu", weights_only=False)
        if state["config"] == cfg.key() and state["base_digest"] == _base_digest(base):
            model.load_state_dict(state["model"])  # copies onto the model's device
            probe.load_state_dict(state["probe"])
            opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
            step, losses, elapsed = state["step"], state["losses"], state["elapsed"]
            torch.set_rng_state(state["rng"])
            print(f"[pretrain] resumed at step {step} from {partial}", file=log, flush=True)
    start = time.perf_counter() - elapsed
    total = cfg.total_steps
    batches = _batches(_Batches(cfg, world, processor, video_ok, placeholder_ids, pad_id), step, cfg.workers)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16")
    bar = ProgressLine(log)
    while step < total:
        vision_only, batch = next(batches)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with autocast:
            if vision_only:
                answer, region = torch.zeros((), device=device), vision_loss(model, probe, batch)
            else:
                answer, region = conversation_losses(model, probe, batch, placeholder_ids)
        loss = answer + cfg.region_weight * region
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        losses.append((round(answer.item(), 4), round(region.item(), 4)))
        elapsed = time.perf_counter() - start
        recent = losses[max(len(losses) - 20, 0 if vision_only else cfg.vision_steps):]  # this phase only
        answer_text = "vision tower only" if vision_only else \
            f"answer loss {sum(a for a, _ in recent) / len(recent):.3f}"
        bar.update(f"[pretrain] step {step}/{total} {answer_text}, region loss "
                   f"{sum(r for _, r in recent) / len(recent):.3f} ({elapsed:.0f} s)")
        out_of_time = cfg.max_seconds is not None and elapsed >= cfg.max_seconds
        if step % cfg.save_every == 0 and step < total and not out_of_time:
            partial.mkdir(parents=True, exist_ok=True)
            torch.save({"config": cfg.key(), "base_digest": _base_digest(base), "step": step, "losses": losses,
                        "elapsed": elapsed, "model": model.state_dict(), "probe": probe.state_dict(),
                        "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": torch.get_rng_state()},
                       partial / "state.pt.tmp")
            (partial / "state.pt.tmp").replace(partial / "state.pt")
        if out_of_time:
            break
    bar.end()
    model.to("cpu")  # saved from the CPU so the checkpoint loads anywhere
    _save(model, processor, base, out, cfg, step, losses, elapsed)
    shutil.rmtree(partial, ignore_errors=True)
    print(f"[pretrain] {step} steps in {elapsed:.0f} s -> {out}", file=log, flush=True)
    return out


def _cpu_seconds() -> float:
    """CPU time of this process so far (all threads): comparable across loaded and idle machines."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _save(model, processor, base: Path, out: Path, cfg: PretrainConfig, step: int, losses: list, seconds: float):
    from zoo import read_zoo_record

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.eval()
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    record = {"base": str(base), "base_digest": _base_digest(base), "base_zoo": read_zoo_record(base),
              "config": cfg.key(), "steps_done": step, "seconds": round(seconds, 1),
              "cpu_seconds": round(_cpu_seconds(), 1), "loss_first": losses[:5], "loss_last": losses[-5:],
              "created_by": "vlora pretrain"}
    (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def pretrained_ref(ref, out: str | Path | None = None, cfg: PretrainConfig | None = None, log=None):
    """The `ModelRef` of `ref`'s pretraining (built now when missing or stale, else reused).

    out defaults to `<ref.path>_pretrained` beside the base checkpoint; the returned name is
    `<ref.name>_pretrained`.
    """
    from .model import ModelRef

    cfg = cfg or PretrainConfig()
    out = Path(out) if out is not None else Path(str(ref.path).rstrip("/") + "_pretrained")
    path = pretrain(ref.path, out, cfg, log=log)
    return ModelRef(name=f"{ref.name}_pretrained", path=str(path), arch=ref.arch, dtype=ref.dtype)
