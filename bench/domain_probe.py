"""Domains alone on the GPU profile's small model: distil them, pretrain qwen2_vl_small on the world
(cached by its settings) or take a pretrained checkpoint, then train a LoRA + the domain's head for
each number of epochs, batch size and seed, and score the eval split. Answers whether a domain can
reach its requirement at all before fusion tries to share an adapter with it, and what a larger
batch costs in accuracy.

    VLORA_HOME=$PWD/.vlora python -m bench.domain_probe --domains detect_car --steps 3000 --epochs 4 24
    VLORA_HOME=$PWD/.vlora python -m bench.domain_probe --domains direction --steps 3000 --epochs 4 12
    VLORA_HOME=$PWD/.vlora python -m bench.domain_probe --pretrained $VLORA_HOME/gpu/zoo/qwen2_vl_small_pretrained \
        --domains class_main count_cars --epochs 4 --batch-sizes 16 64 --seeds 0 1 --out /tmp/probe.csv
    ... --domains detect_car --copies with without    # an augmented domain with and without its copies

The domains are distilled as the GPU profile distils them (conf/demo.yaml); already distilled datasets
are kept.
Needs the teachers in $VLORA_HOME/teachers. Learning rates follow the square root of the batch
from the profile's batch 16 (LoRA 1e-3, head 1e-2) unless given. Results on an H100:
results/offline_gpu/. An experiment, printed; nothing passes or fails.
"""
import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from train import LoraSpec, LoraTrainer, VisionLM
from train.model import ModelRef
from train.pretrain import PretrainConfig, pretrain
from train.trainer import TrainConfig
from zoo import build_checkpoint

NAME = "qwen2_vl_small"
DEMO_CONF = Path(__file__).resolve().parents[1] / "conf" / "demo.yaml"


def profile_overrides() -> list[str]:
    """The GPU profile's offline overrides (conf/demo.yaml): read from there, not copied, so the
    probe distils and pretrains as a profile run does and shares its datasets and checkpoint."""
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(DEMO_CONF).demo.gpu.offline]


def profile_domains() -> dict[str, str]:
    """The profile's `distill.domains.<name>={...}` overrides, by domain."""
    return {o.split("=", 1)[0].rsplit(".", 1)[1]: o for o in profile_overrides() if o.startswith("distill.domains.")}


def profile_distill_settings() -> list[str]:
    """The profile's other `distill.*` overrides (workers that render the world and call the teachers)."""
    return [o for o in profile_overrides() if o.startswith("distill.") and not o.startswith("distill.domains.")]


def profile_pretrain(seed: int, changes: list[str] = ()) -> PretrainConfig:
    """The profile's world pretraining (`train.pretrain={...}`), with the run's seed as `vlora train`
    gives it and `changes` (`key=value`, read as Hydra reads overrides) on top: a probe of another pretraining."""
    import yaml
    from omegaconf import OmegaConf

    line = next(o for o in profile_overrides() if o.startswith("train.pretrain="))
    settings = {"seed": seed, **yaml.safe_load(line.split("=", 1)[1])}
    for change in changes:
        key, sep, value = change.partition("=")
        if not sep or key not in PretrainConfig.__dataclass_fields__:
            raise ValueError(f"--pretrain-set {change!r}: expected key=value with a key of PretrainConfig "
                             f"({', '.join(PretrainConfig.__dataclass_fields__)})")
        settings[key] = OmegaConf.to_container(OmegaConf.from_dotlist([change]))[key]  # 7e-4 a float, as Hydra reads it
    return PretrainConfig(**settings)


def first_items(data, n: int | None):
    """The domain with the first `n` training originals (by id) and their mirrored / reversed
    copies (ids `<original>+<transforms>`); eval unchanged. A learning curve on one eval split."""
    from dataclasses import replace

    from datasets import DatasetDict

    train = data.splits["train"]
    originals = sorted(i for i in train["id"] if "+" not in i)
    if n is None or n >= len(originals):
        return data
    keep = set(originals[:n])
    train = train.filter(lambda i: i.split("+", 1)[0] in keep, input_columns="id")
    return replace(data, splits=DatasetDict({"train": train, "eval": data.splits["eval"]}))


def rates(batch: int, lr: float | None, head_lr: float | None) -> tuple[float, float]:
    """LoRA and head learning rates at `batch`: given, or the profile's at batch 16 scaled by sqrt(batch / 16)."""
    scale = (batch / 16) ** 0.5
    return (lr if lr is not None else 1e-3 * scale), (head_lr if head_lr is not None else 1e-2 * scale)


def originals_only(data):
    """The domain without its mirrored / reversed copies (ids with a '+'): the paired comparison."""
    from dataclasses import replace

    from datasets import DatasetDict

    train = data.splits["train"].filter(lambda i: "+" not in i, input_columns="id")
    return replace(data, info=replace(data.info, augment={}),
                   splits=DatasetDict({"train": train, "eval": data.splits["eval"]}))


def main() -> None:
    ap = argparse.ArgumentParser(description="domains alone on the GPU profile's small model")
    ap.add_argument("--domains", nargs="+", default=["detect_car"])
    ap.add_argument("--steps", type=int, default=None,
                    help="world pretraining steps at batch 32 (the profile's first setting); default: the profile's pretraining")
    ap.add_argument("--pretrained", default=None, help="a pretrained checkpoint directory to use instead")
    ap.add_argument("--epochs", type=int, nargs="+", default=[4, 24])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--head-lr", type=float, default=None)
    ap.add_argument("--world-seed", type=int, default=0, help="the seed the domains are distilled with (`seed=`)")
    ap.add_argument("--out", default=None, help="also write the rows as CSV here")
    ap.add_argument("--copies", nargs="+", choices=["with", "without"], default=["with"],
                    help="train on the mirrored / reversed copies of an augmented domain, on its originals only, or both")
    ap.add_argument("--train-sizes", type=int, nargs="+", default=[None],
                    help="train on the first N training originals (and their copies) of each domain: a learning curve")
    ap.add_argument("--pretrain-set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="change the profile's pretraining, e.g. turns=6 (its checkpoint is cached apart)")
    ap.add_argument("--zero-shot", action="store_true",
                    help="also score the pretrained base's decoded answers on each domain's eval split, no adapter")
    args = ap.parse_args()
    if args.pretrain_set and (args.pretrained or args.steps is not None):
        ap.error("--pretrain-set changes the profile's pretraining; --pretrained and --steps use another one")
    try:
        pcfg = profile_pretrain(args.world_seed, args.pretrain_set)
    except (ValueError, TypeError) as e:
        ap.error(str(e))
    home = os.environ.get("VLORA_HOME", ".vlora")
    t0 = time.time()
    profile = profile_domains()
    unknown = [d for d in args.domains if d not in profile]
    if unknown:
        ap.error(f"--domains {unknown}: the GPU profile distils {sorted(profile)}")
    sizes = [profile[d] for d in args.domains]
    subprocess.run([sys.executable, "-m", "vlora", "distill", f"paths.home={home}/gpu", f"teachers.dir={home}/teachers",
                    f"model={NAME}", f"seed={args.world_seed}", f"distill.only=[{','.join(args.domains)}]", *profile_distill_settings(),
                    *sizes], check=True)
    print(f"distill {time.time() - t0:.0f} s", flush=True)
    if args.pretrained:
        out = args.pretrained
    elif args.steps is None:
        base = build_checkpoint(NAME, f"{home}/gpu/zoo/{NAME}", seed=args.world_seed)
        t0 = time.time()
        out = pretrain(base, f"{home}/gpu/zoo/{NAME}_pretrained", pcfg, log=sys.stdout)
        print(f"pretrain (the profile's): {time.time() - t0:.0f} s in this call", flush=True)
    else:
        base = build_checkpoint(NAME, f"{home}/gpu/zoo/{NAME}")
        t0 = time.time()
        pcfg = PretrainConfig(steps=args.steps, batch_size=32, lr=1e-3, warmup_steps=100, mixed_precision="bf16",
                              workers=14)
        out = pretrain(base, f"{home}/gpu/zoo/{NAME}_pre{args.steps}", pcfg, log=sys.stdout)
        print(f"pretrain {args.steps} steps: {time.time() - t0:.0f} s in this call", flush=True)
    vlm = VisionLM(ModelRef(name=NAME, path=str(out), arch="qwen2_vl", dtype="float32"), LoraSpec(),
                   mixed_precision="bf16")
    rows = []
    if args.zero_shot:
        from train.evaluate import zero_shot

        trainer = LoraTrainer(vlm, f"{home}/gpu/datasets", TrainConfig(eval_batch_size=64))
        for domain in args.domains:
            data = trainer.dataset(domain)
            score, n = zero_shot(vlm, data, data.size("eval"), trainer.cfg.max_new_tokens)
            rows.append({"domain": domain, "copies": "base", "train": 0, "batch": 0, "lr": 0, "head_lr": 0,
                         "epochs": 0, "seed": args.world_seed, "eval": round(score, 4), "seconds": 0})
            print(f"{out}: the base alone on {domain}, decoded, {int(n)} eval items: {score:.3f}", flush=True)
    for domain, copies, n in [(d, c, n) for d in args.domains for c in args.copies for n in args.train_sizes]:
        for batch in args.batch_sizes:
            lr, head_lr = rates(batch, args.lr, args.head_lr)
            for epochs in args.epochs:
                for seed in args.seeds:
                    trainer = LoraTrainer(vlm, f"{home}/gpu/datasets",
                                          TrainConfig(epochs=epochs, batch_size=batch, lr=lr, head_lr=head_lr,
                                                      eval_batch_size=64, seed=seed))
                    data = first_items(trainer.dataset(domain), n)
                    trainer._data[domain] = originals_only(data) if copies == "without" else data
                    t0 = time.time()
                    torch.manual_seed(seed)
                    state = trainer.train(trainer.new_adapter(1), domain)
                    score = trainer.evaluate(state, domain)
                    row = {"domain": domain, "copies": copies, "train": trainer.dataset(domain).size("train"),
                           "batch": batch, "lr": lr, "head_lr": head_lr, "epochs": epochs,
                           "seed": seed, "eval": round(score, 4), "seconds": round(time.time() - t0, 1)}
                    rows.append(row)
                    print(f"{out}: LoRA + head on {domain} ({row['train']} training rows), batch {batch} (lr {lr:.2g}, head {head_lr:.2g}), "
                          f"{epochs} epochs, seed {seed}: eval {score:.3f} ({row['seconds']} s)", flush=True)
                    if args.out:
                        with open(args.out, "w", newline="") as f:
                            w = csv.DictWriter(f, fieldnames=list(rows[0]))
                            w.writeheader()
                            w.writerows(rows)


if __name__ == "__main__":
    main()
