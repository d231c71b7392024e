"""Where a prefill-sized ATMM op spends its time: each launch alone against its own floor, the
two together, and the one-launch fused kernel over a small tiling space beside them.

    python -m bench.prefill_parts --tokens 1024 2048 --ranks 16 64 --out DIR

The whole op's floor is the roofline of its bytes (x read, y read and written, the weights, v
written and read); each launch's is its share of them (`workload.floor_cost`). A whole op far
above the sum of its halves' times is launch and ramp overhead between the two; halves far above
their own floors are the kernels. The fused kernel answers whether one launch, which recomputes
v per column group, beats two at these sizes (it was measured only at decode sizes before).
Hidden 4096, fp16, the table's tilings for the two launches, CUDA-graph medians with L2-cold
rotation as `vlora bench`.

For one adapter (the `identical` mix) it also times the same op as two dense cuBLAS calls,
`v = x @ A.T` then `y += scale * v @ B.T` (no segments, no token order, v in fp16): what the
vendor's matmuls reach on the same bytes, a practical floor beside the roofline one.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

from kernels.expand import expand
from kernels.fused import fused_add_lora
from kernels.lora import add_lora, configs_for, default_table
from kernels.search import precompile
from kernels.shrink import shrink
from kernels.tiling import TileConfig, config_space, shape_key
from kernels.timing import copy_bandwidth_gbs, matmul_tflops, roofline_us, time_op
from kernels.workload import MIXES, LoRAShape, Rotation, floor_cost

from .kernels import _problems
from .results import write_csv

HIDDEN = 4096


def fused_space(rank: int) -> list[TileConfig]:
    """The fused kernel's search space (`tiling.config_space`) cut to what is worth trying at
    prefill sizes: short token tiles (many programs, each recomputing v for its rows), K steps of
    128-256, and column groups of 512-2048 columns."""
    key = shape_key("fused", 1024, 1024, HIDDEN, HIDDEN, rank, 1)
    return [c for c in config_space(key) if c.block_m <= 32 and c.block_n >= 64 and c.block_k >= 128
            and c.col_tiles >= 4 and c.block_n * c.col_tiles >= 512]


def measure(shape: LoRAShape, l2_bytes: int, tflops: float, gbs: float, fused_configs: int | None,
            warmup: int, repeats: int) -> dict:
    problems = _problems(shape, torch.float16, l2_bytes)
    table = default_table()
    s_cfg, e_cfg = configs_for(problems[0][1], problems[0][2], problems[0][4], shape.slices, table)
    timed = functools.partial(time_op, warmup=warmup, repeats=repeats)

    def whole(p):
        return add_lora(*p, shrink_config=s_cfg, expand_config=e_cfg)

    vs = [shrink(p[1], p[2], p[4], p[5], s_cfg) for p in problems]  # v for the expand timed alone
    row = dict(tokens=shape.tokens, mix=shape.mix, rank=shape.rank,
               floor_us=round(roofline_us(*floor_cost(shape), tflops, gbs), 2),
               atmm_us=round(timed(Rotation(problems, whole)), 2),
               shrink_us=round(timed(Rotation(problems, lambda p: shrink(p[1], p[2], p[4], p[5], s_cfg))), 2),
               expand_us=round(timed(Rotation(list(zip(problems, vs)), lambda pv: expand(
                   pv[0][0], pv[1], pv[0][3], pv[0][4], pv[0][5], pv[0][6], pv[0][7], e_cfg))), 2),
               shrink_config=str(s_cfg), expand_config=str(e_cfg))
    for half in ("shrink", "expand"):
        row[f"{half}_floor_us"] = round(roofline_us(*floor_cost(shape, half), tflops, gbs), 2)
    if fused_configs != 0 and shape.rank <= 128:
        space = fused_space(shape.rank)[:fused_configs or None]
        quick = [(time_op(Rotation(problems, lambda p, c=c: fused_add_lora(*p, c)), warmup=1, repeats=3), c)
                 for c in space]
        best = min(((timed(Rotation(problems, lambda p, c=c: fused_add_lora(*p, c))), c)
                    for _, c in sorted(quick, key=lambda q: q[0])[:4]), key=lambda b: b[0])
        row.update(fused_us=round(best[0], 2), fused_config=str(best[1]), fused_tried=len(space))
    if shape.mix == "identical":
        row.update(dense_times(problems, timed))
    row["x_floor"] = round(row["atmm_us"] / row["floor_us"], 2)
    return row


def dense_problem(p: tuple) -> tuple:
    """One problem of one adapter as (y, x, A (r, k), B (n, r), scale, v): the adapter is the slot
    of the first segment; v is an fp16 buffer for x @ A.T."""
    y, x, lora_a, lora_b, meta, _, scales, _ = p
    slot = meta.host_segments[0][0]
    v = torch.empty(x.shape[0], lora_a.shape[2], dtype=x.dtype, device=x.device)
    return y, x, lora_a[0, slot], lora_b[slot], float(scales[slot]), v


def dense_shrink(d: tuple) -> None:
    torch.mm(d[1], d[2].t(), out=d[5])


def dense_expand(d: tuple) -> None:
    d[0].addmm_(d[5], d[3].t(), alpha=d[4])


def dense_op(d: tuple) -> None:
    dense_shrink(d)
    dense_expand(d)


def dense_times(problems: list[tuple], timed) -> dict:
    """The one-adapter op as cuBLAS calls on the adapter's own weights, whole and by half."""
    dense = [dense_problem(p) for p in problems]
    return dict(dense_us=round(timed(Rotation(dense, dense_op)), 2),
                dense_shrink_us=round(timed(Rotation(dense, dense_shrink)), 2),
                dense_expand_us=round(timed(Rotation(dense, dense_expand)), 2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024])
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES)
    ap.add_argument("--fused-configs", type=int, default=None, help="at most this many fused tilings (0: none)")
    ap.add_argument("--workers", type=int, default=14, help="processes compiling the fused tilings")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.prefill_parts times CUDA kernels: no CUDA device here")
    props = torch.cuda.get_device_properties(0)
    gbs, tflops = copy_bandwidth_gbs(), matmul_tflops()
    print(f"{props.name}: copy {gbs:.0f} GB/s, matmul {tflops:.0f} TFLOP/s", flush=True)
    if args.fused_configs != 0:  # the fused tilings compile in parallel first, into Triton's disk cache
        work = [("fused", c, LoRAShape(16, "distinct", r, HIDDEN, (HIDDEN,)))
                for r in args.ranks for c in fused_space(r)[:args.fused_configs]]
        with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
            precompile(work, "float16", args.workers, pool)
    rows = []
    for t, r, mix in itertools.product(args.tokens, args.ranks, args.mixes):
        shape = LoRAShape(t, mix, r, HIDDEN, (HIDDEN,))
        rows.append(measure(shape, props.L2_cache_size, tflops, gbs, args.fused_configs, args.warmup, args.repeats))
        print({k: v for k, v in rows[-1].items() if not k.endswith("config")}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "prefill_parts.csv", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
