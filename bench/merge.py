"""Benchmark: merge one adapter into every layer of a 7B model, against a per-layer addmm_ loop.

    python -m bench.merge [--ranks 16 64] [--csv merge.csv]

Times go through `vlora_kernels.timing.time_op` with use_graph=False: each op runs for milliseconds,
so host launch gaps (4 launches for the kernel, L x 7 for the loop) hide behind GPU work.
"""

from __future__ import annotations

import argparse
import sys

import torch

from vlora_kernels.merge import MergeGroup, merge_floor_bytes, merge_groups_
from vlora_kernels.timing import copy_bandwidth_gbs, time_op
from .results import write_csv

SHAPES = {  # name: (layers, hidden, q width, k/v width, intermediate)
    "llava_7b": (32, 4096, 4096, 4096, 11008),
    "qwen2_vl_7b": (28, 3584, 3584, 512, 18944),  # 28 heads, 4 kv heads of 128
}
N_SLOTS, SLOT = 4, 2  # a small pool; the merged slot sits in the middle


def _group(layers: int, widths: list[int], k: int, rank: int, dtype: torch.dtype) -> MergeGroup:
    n_total, n_slices = sum(widths), len(widths)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    dev = "cuda"
    # random, small enough that repeated merges during timing never overflow
    weight = torch.empty(layers, n_total, k, dtype=dtype, device=dev).normal_(0, 0.02)
    lora_a = torch.empty(layers, n_slices, N_SLOTS, rank, k, dtype=dtype, device=dev).normal_(0, 0.01)
    lora_b = torch.empty(layers, N_SLOTS, n_total, rank, dtype=dtype, device=dev).normal_(0, 0.01)
    ranks = torch.full((n_slices, N_SLOTS), rank, dtype=torch.int32, device=dev)
    scales = torch.full((N_SLOTS,), 2.0, dtype=torch.float32, device=dev)
    return MergeGroup(weight, lora_a, lora_b, ranks, scales,
                      torch.tensor(offsets, dtype=torch.int32, device=dev))


def build_groups(shape_name: str, rank: int, dtype: torch.dtype) -> dict[str, MergeGroup]:
    layers, hidden, q, kv, inter = SHAPES[shape_name]
    return {
        "qkv": _group(layers, [q, kv, kv], hidden, rank, dtype),
        "o": _group(layers, [hidden], q, rank, dtype),
        "gate_up": _group(layers, [inter, inter], hidden, rank, dtype),
        "down": _group(layers, [hidden], inter, rank, dtype),
    }


def addmm_loop(groups: list[MergeGroup], slot: int):
    """The baseline as a closure: one `weight[l].addmm_(B, A, alpha=scale)` per layer and
    projection, in the weight dtype; offsets, ranks and scales are read once, outside the timing."""
    plan = []
    for g in groups:
        offsets, ranks, scale = g.slice_offsets.tolist(), g.ranks[:, slot].tolist(), float(g.scales[slot])
        for i, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
            for layer in range(g.weight.shape[0]):
                plan.append((g.weight[layer, lo:hi], g.lora_b[layer, slot, lo:hi, :ranks[i]],
                             g.lora_a[layer, i, slot, :ranks[i]], scale))

    def run():
        for w, b, a, alpha in plan:
            w.addmm_(b, a, alpha=alpha)
    return run


def bench_merge(shape_name: str, rank: int, dtype: torch.dtype, gbs: float) -> list[dict]:
    """Rows for the q/k/v/o-only and the all-projection merge of one slot, kernel vs addmm_ loop."""
    groups = build_groups(shape_name, rank, dtype)
    rows = []
    try:
        for modules, names in (("qkvo", ["qkv", "o"]), ("all", list(groups))):
            chosen = [groups[n] for n in names]
            floor_us = merge_floor_bytes(chosen, slot=SLOT) / (gbs * 1e9) * 1e6
            timed = {
                ("atmm_merge", "merge"): lambda: merge_groups_(chosen, SLOT, sign=1),
                ("atmm_merge", "unmerge"): lambda: merge_groups_(chosen, SLOT, sign=-1),
                ("addmm_loop", "merge"): addmm_loop(chosen, SLOT),
            }
            for (impl, op), fn in timed.items():
                us = time_op(fn, warmup=3, repeats=15, use_graph=False)
                rows.append({"op": "merge_all" if op == "merge" else "unmerge_all", "model": shape_name,
                             "modules": modules, "rank": rank, "impl": impl, "us": round(us, 1),
                             "floor_us": round(floor_us, 1), "x_floor": round(us / floor_us, 3)})
    finally:
        del groups
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SHAPES))
    parser.add_argument("--ranks", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--csv", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    gbs = copy_bandwidth_gbs()
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {gbs:.0f} GB/s (read + write)")
    rows = [row for model in args.models for rank in args.ranks
            for row in bench_merge(model, rank, torch.bfloat16, gbs)]
    keys = list(rows[0])
    print(" ".join(f"{k:>12}" for k in keys))
    for row in rows:
        print(" ".join(f"{row[k]!s:>12}" for k in keys))
    if args.csv:
        write_csv(args.csv, rows, keys)


if __name__ == "__main__":
    main(sys.argv[1:])
