"""Where a LoRA training step of fusion goes: reading a batch's rows (whole, and without the
pictures of items already encoded), the encoder's cache, collating, the model step alone, the
trainer's own loop (eager, and compiled when asked), a profile, evaluation and a head re-fit.

    VLORA_HOME=$PWD/.vlora python -m bench.lora_step --datasets $VLORA_HOME/gpu/datasets \\
        --domains class_main detect_car --out results/train_step/<gpu>

The model is a zoo checkpoint with random weights (`--model`, the GPU profile's qwen2_vl_small by
default): speed does not depend on what the weights hold. The datasets are any distilled domains
(`vlora distill`). Prints and writes `lora_step.txt`; timings only, nothing passes or fails.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from heads import build_head
from train import LoraSpec, ModelRef, VisionLM, load_domain
from train.data import collate, head_target
from train.evaluate import evaluate
from train.model import AdapterModule, frozen_linears_to
from train.rehearsal import Part, refit_heads
from train.trainer import TrainConfig, _batch_loss, head_config_for, train_adapter
from zoo import build_checkpoint

from .results import Tee


def _timed(fn, repeats: int, device: torch.device) -> float:
    """Mean milliseconds of `fn()` over `repeats` calls, the device synchronised around them."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats * 1000


def _loop(vlm, data, cfg: TrainConfig) -> float:
    """Steps a second of the trainer's own loop over `cfg.max_steps` steps (features cached), as
    its progress line reports it: the run's set-up and clean-up are not counted."""
    log = io.StringIO()
    train_adapter(vlm, data, cfg, log=log, evaluate_at_end=False)
    return float(re.findall(r"\(([0-9.]+) steps/s\)", log.getvalue())[-1])


def run_domain(vlm: VisionLM, data, batch_size: int, steps: int, repeats: int, compile_too: bool, profile: bool,
               out) -> None:
    dev, info, enc = vlm.device, data.info, vlm.encoder
    say = lambda s: print(f"[{info.name} b{batch_size}] {s}", file=out, flush=True)  # noqa: E731
    n = data.size("train")
    idx = list(range(min(batch_size, n)))
    say(f"rows whole (pictures decoded): {_timed(lambda: data.rows('train', idx), repeats, dev):.1f} ms/batch")
    t = time.perf_counter()
    for s in range(0, n, 32):  # every train item through the processor and the tower once
        enc.encode_many(data.rows("train", range(s, min(n, s + 32)), enc), info)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    say(f"first encoding (processor + tower): {(time.perf_counter() - t) / n * 1000:.2f} ms/item over {n} items")
    rows = data.rows("train", idx, enc)
    say(f"rows, pictures of encoded items skipped: {_timed(lambda: data.rows('train', idx, enc), repeats, dev):.1f} "
        "ms/batch")
    say(f"encoder cache hits: {_timed(lambda: enc.encode_many(rows, info), repeats, dev):.2f} ms/batch")
    items = enc.encode_many(rows, info)
    answers = [enc.answer_ids(r["answer"]) for r in rows] if info.task == "lm" else None
    say(f"collate: {_timed(lambda: collate(items, enc.pad_id, answers), repeats, dev):.2f} ms/batch")
    head = None if info.task == "lm" else build_head(head_config_for(info, vlm.hidden_size)).to(dev)
    module = AdapterModule(vlm.model, head)
    params = vlm.lora_parameters() + (list(head.parameters()) if head is not None else [])
    opt = torch.optim.AdamW(params, lr=1e-4)
    targets = [head_target(info, r) for r in rows]
    batch = collate(items, enc.pad_id, answers)

    def step():
        with vlm.accelerator.autocast():
            loss = _batch_loss(module, head, batch, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    say(f"model step alone (forward, backward, clip, AdamW): {_timed(step, repeats, dev):.1f} ms")
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profiler(activities=activities) as prof:
            for _ in range(4):
                step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
        say(f"profile of 4 model steps: {launches} kernel launches")
        print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60), file=out)
    cfg = TrainConfig(epochs=max(1, -(-steps * batch_size // n)), max_steps=steps, batch_size=batch_size, lr=1e-3,
                      head_lr=1e-2, eval_batch_size=32)
    _loop(vlm, data, replace(cfg, max_steps=5))  # warm-up
    say(f"trainer loop, eager: {_loop(vlm, data, cfg):.1f} steps/s over {steps} steps")
    prof = cProfile.Profile()
    prof.enable()
    _loop(vlm, data, cfg)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    say("trainer loop under cProfile, by own time:")
    print("\n".join(text.getvalue().splitlines()[6:]), file=out)
    if compile_too:
        t = time.perf_counter()
        _loop(vlm, data, replace(cfg, max_steps=20, compile=True))
        say(f"trainer loop, compiled: first 20 steps {time.perf_counter() - t:.1f} s (compilation included)")
        say(f"trainer loop, compiled: {_loop(vlm, data, replace(cfg, compile=True)):.1f} steps/s over {steps} steps")
    t = time.perf_counter()
    metrics = evaluate(vlm, head, data, "eval", 32) if head is not None else {"n": 0}
    say(f"evaluation of the eval split: {time.perf_counter() - t:.2f} s ({metrics['n']} items)")
    if head is not None:
        t = time.perf_counter()
        refit_heads(vlm, [Part(data, head)], cfg, 3, io.StringIO())
        say(f"head re-fit, 3 epochs over {n} items: {time.perf_counter() - t:.2f} s")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", required=True, help="a folder of distilled domains (`vlora distill`)")
    ap.add_argument("--domains", nargs="+", required=True)
    ap.add_argument("--model", default="qwen2_vl_small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16])
    ap.add_argument("--steps", type=int, default=60, help="steps of each trainer-loop timing")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--frozen", nargs="+", default=["autocast"], choices=["autocast", "float32"],
                    help="dtype of the frozen decoder projections: the trainer's (autocast's), or float32 as "
                         "the checkpoint stores them (autocast then casts them on every call)")
    ap.add_argument("--compile", action="store_true", help="also time the loop with train.compile")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--out", default=None, help="folder for lora_step.txt (besides stdout)")
    a = ap.parse_args(argv)
    out = Tee()
    path = build_checkpoint(a.model, Path(tempfile.mkdtemp(prefix="lora_step_")) / a.model)
    dev = torch.device(a.device)
    bf16 = dev.type == "cuda"  # the GPU profile trains under bf16 autocast
    vlm = VisionLM(ModelRef(a.model, str(path)), LoraSpec(), mixed_precision="bf16" if bf16 else "no", device=a.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"{a.model} on {name}, torch {torch.__version__}", file=out)
    domains = [load_domain(Path(a.datasets) / domain) for domain in a.domains]
    for frozen in a.frozen:  # set each time, so any order of --frozen measures what it names
        frozen_linears_to(vlm.model, torch.bfloat16 if bf16 and frozen == "autocast" else torch.float32)
        print(f"frozen decoder projections: {frozen}", file=out)
        for data in domains:
            for batch_size in a.batch_sizes:
                run_domain(vlm, data, batch_size, a.steps, a.repeats, a.compile, not a.no_profile, out)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "lora_step.txt").write_text(out.text)


if __name__ == "__main__":
    main()
