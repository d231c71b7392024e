"""Kernel benchmark: ATMM (searched table, best single static tiling, heuristic) against the
PyTorch baselines and the Triton SGMV (Punica) and MBGMV (S-LoRA) kernels over token counts x
adapter mixes x ranks x hidden sizes, each beside its roofline floor from the device's measured
copy bandwidth and matmul rate. Each row holds the median call (`us`) and the p50/p90/p99 of the
timed runs. `atmm` is what the engine runs: the table's one-launch op where the table picks one
(`TilingTable.one_launch`; the two launches are then also timed as `atmm_two_launch`), else the
two launches at the table's tilings. Decode shapes (up to FUSED_MAX_TOKENS tokens) also time both
one-launch kernels pinned, as `atmm_fused` and `atmm_handoff`, at the table's (or heuristic's)
tiling of each. On a device with programmatic dependent launch, the two launches run the expand
behind the shrink with it (as the engine does) and `atmm_nopdl` is the same tiling without it. Decode shapes also
time `atmm_anymix`: the batch's metadata padded as the engine's decode graph for any adapter mix
pads it (segments bounded by the whole batch), with the tiling of that padding, which is what a
step runs when no graph of `lora_graph_segments` x `lora_graph_seg_lens` holds its mix.
Shapes where either launch lays its token tiles on the flat grid (`vlora_kernels/token_tiles.py`)
also time `atmm_grid2d`: the same tiling on the by-segment grid.

Writes kernels.csv, summary.json and kernels.png to the output folder and prints a summary.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vlora_kernels.baselines import lora_mbgmv, lora_sgmv
from vlora_kernels.interpreter import pdl_available
from vlora_kernels.lora import add_lora, configs_for, default_table, one_launch_for, pinned
from vlora_kernels.reference import lora_einsum, lora_gather_bmm, lora_loop
from vlora_kernels.segments import build_segments
from vlora_kernels.table import TilingTable
from vlora_kernels.tiling import (FUSED_MAX_RANK, FUSED_MAX_TOKENS, ONE_LAUNCH_OPS, TileConfig, heuristic_config,
                            shape_key)
from vlora_kernels.token_tiles import seg_block
from vlora_kernels.timing import copy_bandwidth_gbs, matmul_tflops, roofline_us, time_op_tails
from vlora_kernels.workload import (DTYPES, LoRAShape, Rotation, copies_to_defeat_cache, floor_cost, longest_segment,
                              make_problem, token_slots)
from .results import write_csv

BASELINES = {"loop": lora_loop, "gather_bmm": lora_gather_bmm, "einsum": lora_einsum, "sgmv": lora_sgmv,
             "mbgmv": lora_mbgmv}
STATIC_CANDIDATES = 12  # per op


@dataclass
class BenchJob:
    tokens: list[int]
    mixes: list[str]
    ranks: list[int]
    hidden_sizes: list[int]
    out_dir: str
    dtype: str = "float16"
    warmup: int = 10
    repeats: int = 30
    baselines: list[str] = field(default_factory=lambda: list(BASELINES))
    merge_models: list[str] = field(default_factory=lambda: ["llava_7b"])
    merge_ranks: list[int] = field(default_factory=lambda: [16, 64])


def grid(job: BenchJob) -> list[LoRAShape]:
    return [LoRAShape(t, mix, r, h, (h,)) for r in job.ranks for h in job.hidden_sizes
            for mix in job.mixes for t in job.tokens]


def _problems(shape: LoRAShape, dtype, l2_bytes: int) -> list[tuple]:
    out = []
    for seed in range(copies_to_defeat_cache(shape, l2_bytes)):
        y, x, lora_a, lora_b, slot_ids, ranks, scales = make_problem(shape, dtype, "cuda", seed)
        meta = build_segments(slot_ids, "cuda")  # once per forward in the engine: not timed
        out.append((y, x, lora_a, lora_b, meta, ranks, scales, shape.slices))
    return out


def _any_mix(problems: list[tuple], shape: LoRAShape) -> list[tuple]:
    """The same problems with each batch's metadata padded as the engine's decode graph for any
    adapter mix pads it (one segment per adapter up to the batch size, every segment bounded by the
    whole batch), so tiling and grid are those of one adapter over the batch."""
    out = []
    for seed, (y, x, lora_a, lora_b, _, ranks, scales, slices) in enumerate(problems):
        meta = build_segments(token_slots(shape.tokens, shape.mix, seed), "cuda",  # the slots make_problem drew
                              max_segments=min(shape.tokens, lora_b.shape[0]), max_tokens=shape.tokens)
        out.append((y, x, lora_a, lora_b, meta, ranks, scales, slices))
    return out


def _time(problems: list[tuple], impl, job: BenchJob) -> dict[str, float]:
    """Microseconds of one call: `us` (the median) and p50_us, p90_us, p99_us."""
    return time_op_tails(Rotation(problems, lambda p: impl(*p)), warmup=job.warmup, repeats=job.repeats)


def _host_side(problems: list[tuple]) -> list[tuple]:
    """The loop baseline reads ranks and scales on the host, as PEFT's Python loop does."""
    return [(*p[:5], p[5].cpu(), p[6].cpu(), p[7]) for p in problems]


def pick_static(shapes, dtype, l2_bytes, table: TilingTable, job: BenchJob) -> tuple[TileConfig, TileConfig]:
    """The single (shrink, expand) tiling with the best geometric-mean time over the grid,
    chosen among the table's most frequent winners and the heuristic's choices."""
    winners = {"shrink": Counter(), "expand": Counter()}
    for key_text, entry in table.entries.items():
        op = key_text.split("|")[0]
        if op in winners:  # one-launch entries are no tiling of the two launches
            winners[op][TileConfig.from_dict(entry)] += 1
    # The configurations that win most often in the table, plus the heuristic's: a static
    # tiling outside that set would lose on nearly every shape.
    candidates = {op: {cfg for cfg, _ in counts.most_common(STATIC_CANDIDATES)} for op, counts in winners.items()}
    for shape in shapes:
        seg = longest_segment(shape.tokens, shape.mix)
        for op in candidates:
            candidates[op].add(heuristic_config(shape_key(op, shape.tokens, seg, shape.k, shape.n, shape.rank, 1)))
    log_sum = {op: {c: 0.0 for c in cands} for op, cands in candidates.items()}
    quick = BenchJob(job.tokens, job.mixes, job.ranks, job.hidden_sizes, job.out_dir, warmup=2, repeats=5)
    for i, shape in enumerate(shapes, 1):
        problems = _problems(shape, dtype, l2_bytes)
        refs = configs_for(problems[0][1], problems[0][2], problems[0][4], shape.slices, table)
        for op, cands in candidates.items():
            for cfg in cands:
                # the other half stays at the table's choice, so only this op's tiling varies
                pair = (cfg, refs[1]) if op == "shrink" else (refs[0], cfg)
                log_sum[op][cfg] += math.log(_time(problems, pinned(*pair), quick)["us"])
        print(f"\rstatic candidates: shape {i}/{len(shapes)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    best = {op: min(scores, key=scores.get) for op, scores in log_sum.items()}
    return best["shrink"], best["expand"]


def one_launch_impl(shape: LoRAShape, table: TilingTable, op: str):
    """The one-launch kernel `op` ("fused" or "handoff") pinned to the table's tiling of `shape`
    (the heuristic's where the table has none), or None where it is not timed: past decode sizes
    or its largest rank. Pinned, not chosen: it is timed whether or not the table would send the
    batch to it (`TilingTable.one_launch`), so the row shows what the table's choice gains or
    would cost."""
    if shape.tokens > FUSED_MAX_TOKENS or shape.rank > FUSED_MAX_RANK:
        return None
    key = shape_key(op, shape.tokens, longest_segment(shape.tokens, shape.mix), shape.k, shape.n, shape.rank,
                    len(shape.slices))
    return functools.partial(add_lora, **{f"{op}_config": table.lookup(key)})


def run_kernel_bench(job: BenchJob) -> tuple[list[dict], dict]:
    """Times every implementation on every grid shape; returns (rows, run metadata)."""
    props = torch.cuda.get_device_properties(0)
    dtype = DTYPES[job.dtype]
    gbs, tflops = copy_bandwidth_gbs(), matmul_tflops(dtype=dtype)
    print(f"{props.name}: copy {gbs:.0f} GB/s, matmul {tflops:.0f} TFLOP/s", file=sys.stderr)
    table, shapes = default_table(0), grid(job)
    static = pick_static(shapes, dtype, props.L2_cache_size, table, job)
    heuristic = TilingTable(props.name, {}, props.multi_processor_count)
    impls = {"atmm": None, "atmm_static": pinned(*static), **{b: BASELINES[b] for b in job.baselines}}
    date = dt.date.today().isoformat()
    rows = []
    for i, shape in enumerate(shapes, 1):
        problems = _problems(shape, dtype, props.L2_cache_size)
        flops, n_bytes = floor_cost(shape)
        floor = roofline_us(flops, n_bytes, tflops, gbs)
        tuned = configs_for(problems[0][1], problems[0][2], problems[0][4], shape.slices, table)
        guess = configs_for(problems[0][1], problems[0][2], problems[0][4], shape.slices, heuristic)
        # atmm: what the engine runs, the table's one-launch op where it picks one, else its two launches
        one = one_launch_for(problems[0][1], problems[0][2], problems[0][4], shape.slices, table)
        impls["atmm"] = pinned(*tuned) if one is None else functools.partial(add_lora, table=table)
        impls["atmm_heuristic"] = pinned(*guess)
        if pdl_available(torch.device("cuda", 0)):
            impls["atmm_nopdl"] = pinned(*tuned, pdl=False)
        extra = {f"atmm_{op}": impl for op in ONE_LAUNCH_OPS if (impl := one_launch_impl(shape, table, op))}
        if one is not None:
            extra["atmm_two_launch"] = pinned(*tuned)
        any_mix = None
        if shape.tokens <= FUSED_MAX_TOKENS:  # decode: the engine's any-mix graph, tiled for that padding
            any_mix = _any_mix(problems, shape)
            extra["atmm_anymix"] = pinned(*configs_for(any_mix[0][1], any_mix[0][2], any_mix[0][4], shape.slices,
                                                       table))
        meta = problems[0][4]
        if any(seg_block(meta, cfg.block_m) for cfg in tuned):  # the flat token grid, against by segment
            extra["atmm_grid2d"] = pinned(*tuned, flat=False)
        for name, impl in {**impls, **extra}.items():
            args = any_mix if name == "atmm_anymix" else _host_side(problems) if name == "loop" else problems
            times = _time(args, impl, job)
            rows.append(dict(device=props.name, date=date, tokens=shape.tokens, mix=shape.mix, rank=shape.rank,
                             hidden=shape.k, impl=name, **{key: round(us, 3) for key, us in times.items()},
                             floor_us=round(floor, 3), x_floor=round(times["us"] / floor, 3), flops=flops,
                             bytes=n_bytes))
        print(f"\r[{i}/{len(shapes)}] t={shape.tokens} {shape.mix} r={shape.rank} h={shape.k}",
              end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    out = Path(job.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "kernels.csv", rows)
    meta = dict(device=props.name, date=date, copy_gbs=round(gbs, 1), matmul_tflops=round(tflops, 1),
                static_shrink=static[0].to_dict(), static_expand=static[1].to_dict(), dtype=job.dtype)
    return rows, meta
