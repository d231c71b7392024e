"""One domain alone on the GPU profile's small model: distil it, pretrain qwen2_vl_small on the world
(cached by its settings), then train a LoRA + the domain's head for each number of epochs and score
the eval split. Answers whether a domain can reach its requirement at all before fusion tries to
share an adapter with it.

    VLORA_HOME=$PWD/.vlora python -m bench.domain_probe --domain detect_car --steps 3000 --epochs 4 24
    VLORA_HOME=$PWD/.vlora python -m bench.domain_probe --domain direction --steps 3000 --epochs 4 12

The domain's size is the GPU profile's (conf/demo.yaml). Needs the teachers in $VLORA_HOME/teachers.
Results on an H100: results/offline_gpu/. An experiment, printed; nothing passes or fails.
"""
import argparse
import os
import subprocess
import sys
import time

import torch

from train import LoraSpec, LoraTrainer, VisionLM
from train.model import ModelRef
from train.pretrain import PretrainConfig, pretrain
from train.trainer import TrainConfig
from zoo import build_checkpoint

SIZES = {"direction": "{size: 640, eval_fraction: 0.4}"}  # the profile's; every other domain 1024 / 0.25

ap = argparse.ArgumentParser(description="one domain alone on the GPU profile's small model")
ap.add_argument("--domain", default="detect_car")
ap.add_argument("--steps", type=int, default=3000, help="world pretraining steps (batch 32, as the profile)")
ap.add_argument("--epochs", type=int, nargs="+", default=[4, 24])
args = ap.parse_args()
home, name = os.environ.get("VLORA_HOME", ".vlora"), "qwen2_vl_small"
t0 = time.time()
size = SIZES.get(args.domain, "{size: 1024, eval_fraction: 0.25}")
subprocess.run([sys.executable, "-m", "vlora", "distill", f"paths.home={home}/gpu", f"teachers.dir={home}/teachers",
                f"model={name}", f"distill.only=[{args.domain}]", f"distill.domains.{args.domain}={size}"], check=True)
print(f"distill {time.time() - t0:.0f} s", flush=True)
base = build_checkpoint(name, f"{home}/gpu/zoo/{name}")
t0 = time.time()
pcfg = PretrainConfig(steps=args.steps, batch_size=32, lr=1e-3, warmup_steps=100, mixed_precision="bf16", workers=14)
out = pretrain(base, f"{home}/gpu/zoo/{name}_pre{args.steps}", pcfg, log=sys.stdout)
print(f"pretrain {args.steps} steps: {time.time() - t0:.0f} s in this call", flush=True)
vlm = VisionLM(ModelRef(name=name, path=str(out), arch="qwen2_vl", dtype="float32"), LoraSpec(), mixed_precision="bf16")
for epochs in args.epochs:  # the profile's trainer settings, but the number of epochs
    trainer = LoraTrainer(vlm, f"{home}/gpu/datasets",
                          TrainConfig(epochs=epochs, batch_size=16, lr=1e-3, head_lr=1e-2, eval_batch_size=32))
    t0 = time.time()
    torch.manual_seed(0)
    state = trainer.train(trainer.new_adapter(1), args.domain)
    score = trainer.evaluate(state, args.domain)
    print(f"pretrain {args.steps}: LoRA + head on {args.domain}, {epochs} epochs: eval {score:.3f} "
          f"({time.time() - t0:.0f} s)", flush=True)
