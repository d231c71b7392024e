"""Where a world-pretraining step goes: the scene loader alone, the model step alone (transformers'
vision attention, then ours batched per piece length), a profile, and the real loop.

    python -m bench.pretrain_step --model qwen2_vl_small --workers 14 --steps 60 --out results/pretrain/<gpu>

On an H100 (results/pretrain/nvidia_h100_80gb_hbm3/) the step of the GPU profile's small model is
bound by the host (kernel launches, autocast casts, one sync per boolean index), not the GPU.
Prints and writes `pretrain_step.txt`; timings only, nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import torch

from train.pretrain import PretrainConfig, _Batches, _batches, pretrain
from train.pretrain_losses import RegionProbe, conversation_losses
from train.vision_attention import batch_vision_attention
from world import WorldConfig
from zoo import build_checkpoint, load_pretrained

from .results import Tee


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(model_name: str, device: str, workers: int, batch_size: int, steps: int, repeats: int, profile: bool,
        out=sys.stdout) -> None:
    dev = torch.device(device)
    root = Path(tempfile.mkdtemp(prefix="pretrain_step_"))
    path = build_checkpoint(model_name, root / model_name)
    model, processor = load_pretrained(path, dtype="float32", device=str(dev))
    c = model.config
    placeholders = [c.image_token_id, c.video_token_id]
    world = WorldConfig(seed=1000003)
    width = c.get_text_config().hidden_size
    probe = torch.nn.ModuleList([RegionProbe(width, len(world.classes), len(world.colors)) for _ in range(2)]).to(dev)
    model.requires_grad_(True).train()
    params = list(model.parameters()) + list(probe.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    bf16 = dev.type == "cuda"
    cfg = PretrainConfig(steps=max(steps, 2 * repeats + 8), batch_size=batch_size,
                         mixed_precision="bf16" if bf16 else "no", workers=workers)
    data = _Batches(cfg, world, processor, True, placeholders, 0)

    def step(batch):
        batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            answer, region = conversation_losses(model, probe, batch, placeholders)
        (answer + region).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    n = 2 * repeats + 8
    it = _batches(data, 0, workers)
    t = time.perf_counter()
    got = [next(it) for _ in range(n)]
    print(f"loader alone: {(time.perf_counter() - t) / n * 1000:.0f} ms/batch ({workers} workers)", file=out, flush=True)
    image = next(b for _, b in got if "pixel_values" in b)
    clip = next((b for _, b in got if "pixel_values_videos" in b), image)
    for label in ("transformers' vision attention", "batched vision attention"):
        if label.startswith("batched"):
            print(f"patched {batch_vision_attention(model)} vision attention modules", file=out)
        for name, b in (("image", image), ("clip", clip)):
            for _ in range(2):
                step(b)
            _sync(dev)
            t = time.perf_counter()
            for _ in range(repeats):
                step(b)
            _sync(dev)
            print(f"{label}: model step, {name} batch of {batch_size}: "
                  f"{(time.perf_counter() - t) / repeats * 1000:.0f} ms", file=out, flush=True)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profiler(activities=activities) as prof:
            for b in (image, clip, image, clip):
                step(b)
            _sync(dev)
        key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60), file=out)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60), file=out)
    t = time.perf_counter()
    pretrain(path, root / "out", PretrainConfig(steps=steps, batch_size=batch_size, workers=workers, lr=1e-3,
                                                mixed_precision="bf16" if bf16 else "no", device=str(dev)),
             log=io.StringIO())
    print(f"pretrain {steps} steps end to end: {time.perf_counter() - t:.1f} s (load and save included)", file=out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2_vl_small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60, help="steps of the end-to-end pretraining run")
    ap.add_argument("--repeats", type=int, default=10, help="timed model steps per batch kind")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=None, help="folder for pretrain_step.txt (besides stdout)")
    a = ap.parse_args(argv)
    tee = Tee()
    run(a.model, a.device, a.workers, a.batch_size, a.steps, a.repeats, not a.no_profile, out=tee)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "pretrain_step.txt").write_text(tee.text)


if __name__ == "__main__":
    main()
