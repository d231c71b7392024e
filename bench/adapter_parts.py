"""Pieces of the adapter benchmark: random PEFT adapters of a model's shape, request-to-adapter
mixes, the host-to-device swap measurement and head-versus-LM-head latency."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from adapters.layout import peft_key
from adapters.peft import write_peft
from serve.engine import Engine, Request, SamplingParams

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# name -> (rank, adapted modules): the two shapes of issue 5
SHAPES = {"r16_qkvo": (16, ("q_proj", "k_proj", "v_proj", "o_proj")), "r64_all": (64, ALL_MODULES)}


def module_shapes(args) -> dict[str, tuple[str, int, int]]:
    """PEFT module -> (block, in_features, out_features) of a serve.models ModelArgs."""
    h, i = args.hidden_size, args.intermediate_size
    return {"q_proj": ("self_attn", h, args.q_size), "k_proj": ("self_attn", h, args.kv_size),
            "v_proj": ("self_attn", h, args.kv_size), "o_proj": ("self_attn", args.q_size, h),
            "gate_proj": ("mlp", h, i), "up_proj": ("mlp", h, i), "down_proj": ("mlp", i, h)}


def write_peft_adapter(path: Path, args, rank: int, modules: tuple[str, ...], seed: int, dtype: torch.dtype,
                       device: str) -> Path:
    """A PEFT LoRA directory with random weights (drawn on `device`, fast for 7B shapes), in the key
    layout `save_pretrained` writes for these models; PEFT loads it and so does the server."""
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    shapes = module_shapes(args)
    for layer in range(args.num_layers):
        for module in modules:
            block, k, n = shapes[module]
            key = peft_key(layer, block, module)
            a = torch.randn(rank, k, generator=g, device=device, dtype=torch.float32) / k ** 0.5
            b = torch.randn(n, rank, generator=g, device=device, dtype=torch.float32) * 0.02
            tensors[key + ".lora_A.weight"] = a.to(dtype).cpu()
            tensors[key + ".lora_B.weight"] = b.to(dtype).cpu()
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": rf".*\.language_model\..*\.({'|'.join(modules)})"}
    return write_peft(path, tensors, config)


def assign(mix: str, n_requests: int, names: list[str], zipf_alpha: float, seed: int) -> list[str | None]:
    """The adapter of each request: "none", "one", "distinct<N>" (round-robin over N adapters, so N
    distinct in a batch of >= N) or "zipf<N>" (rank-frequency p_k ~ k^-alpha over N adapters)."""
    if mix == "none":
        return [None] * n_requests
    if mix == "one":
        return [names[0]] * n_requests
    m = re.fullmatch(r"(distinct|zipf)(\d+)", mix)
    if m is None:
        raise ValueError(f"mix {mix!r}: expected none, one, distinct<N> or zipf<N>")
    kind, n = m[1], int(m[2])
    if n > len(names):
        raise ValueError(f"mix {mix!r} needs {n} adapters, {len(names)} were written")
    if kind == "distinct":
        return [names[i % n] for i in range(n_requests)]
    p = np.arange(1, n + 1, dtype=np.float64) ** -zipf_alpha
    picks = np.random.default_rng(seed).choice(n, size=n_requests, p=p / p.sum())
    return [names[int(k)] for k in picks]


def pinned_h2d_gbs(n_bytes: int = 1 << 30) -> float:
    """Host (page-locked) to device copy rate in GB/s: the floor of an adapter swap."""
    src = torch.empty(n_bytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n_bytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return n_bytes / (statistics.median(times[1:]) * 1e-3) / 1e9


def swap_ms(engine: Engine, name: str, repeats: int, overlap=None) -> tuple[float, float | None]:
    """Median device time of copying adapter `name` into a slot on the pool's side stream, and with
    `overlap` (a callable queuing decode steps on the main stream) the median step time meanwhile."""
    m = engine.lora
    weights = m.host.get(name) or m.host.put(name, m._read(m.records[name].spec.path)[0])
    free = [i for i, owner in enumerate(m.slots) if owner is None]
    slot = free[0] if free else m.records[name].slot
    if slot is None:
        raise RuntimeError("swap timing needs a free slot or the adapter resident")
    swaps, steps = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(m.stream):
            start.record(m.stream)
            m.pool.write(slot, weights)
            end.record(m.stream)
        if overlap is not None:
            s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s0.record()
            n = overlap()
            s1.record()
        torch.cuda.synchronize()
        swaps.append(start.elapsed_time(end))
        if overlap is not None:
            steps.append(s0.elapsed_time(s1) / n)
    if m.slots[slot] is None:
        m.pool.clear(slot)
    return statistics.median(swaps), statistics.median(steps) if steps else None


def head_latency_ms(engine: Engine, prompts, adapter: str, task: str, answer_tokens: int, batch: int,
                    repeats: int) -> tuple[float, float]:
    """Median request latency (arrival to final output) of head mode and of LM-head decoding of an
    answer of `answer_tokens` tokens, `batch` requests submitted together."""
    def run(mode: str) -> float:
        params = SamplingParams(max_tokens=answer_tokens, ignore_eos=True, detokenize=False)
        requests = [Request(prompt=text, images=[image], adapter=adapter, output_mode=mode,
                            task=task if mode == "head" else None, sampling=params)
                    for text, image in prompts[:batch]]
        outs = engine.generate(requests)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        return statistics.mean(o.metrics.finished_time - o.metrics.arrival_time for o in outs) * 1e3

    run("head"), run("generate")  # warm-up
    head = statistics.median(run("head") for _ in range(repeats))
    lm = statistics.median(run("generate") for _ in range(repeats))
    return head, lm


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start
