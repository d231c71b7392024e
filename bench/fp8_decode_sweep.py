"""Tunes vlora_kernels/fp8_decode.py's launch table on a GPU: per projection shape of Qwen2-VL-7B and token
count, every candidate (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) timed with
`vlora_kernels.timing.time_op` (CUDA graphs, events), each call reading the next of enough weight copies to
pass 256 MB (no weight found in L2), beside the table's own choice and `_scaled_mm`. Prints one line per
(projection, m): the best candidate, its time and weight TB/s, the table's and cuBLAS's; then the best
config per projection summed over the token counts, as CONFIGS lines to paste.

    python -m bench.fp8_decode_sweep --projections down_proj --m 1 32 --out sweep.csv
    python -m bench.fp8_decode_sweep --activations bf16 ...   # the weight-only form (W_CONFIGS lines)
    python -m bench.fp8_decode_sweep --block-n 16 32 ...     # channel tiles under a wgmma's 64, few or no splits

Each candidate compiles once per padded token count (16, 32, 64) and split length: 17-41 candidates
a projection, so one projection a command keeps each call within minutes.
"""

from __future__ import annotations

import argparse
import csv
import itertools

import torch
import triton

from vlora_kernels.fp8 import quantize_rows, quantize_weight, scaled_mm_rows
from vlora_kernels.fp8_decode import BLOCK_NS, CONFIGS, W_CONFIGS, decode_config, fp8_decode_mm, fp8w_decode_mm

SHAPES_7B = {"qkv_proj": (4608, 3584), "o_proj": (3584, 3584), "gate_up_proj": (37888, 3584),
             "down_proj": (3584, 18944)}
L2_PASS_BYTES = 256 << 20
MAX_PROGRAMS = 8 * 132  # more programs than this only add partials to sum
# a program's pipeline: num_stages x (weight tile + 64-token tile) bytes of shared memory, under Hopper's
# 227 KB a block (Triton refuses the launch above it)
MAX_SHARED = 227 << 10


def candidates(n: int, k: int, weight_only: bool = False,
               block_ns: tuple[int, ...] = (64, 128)) -> list[tuple[int, int, int, int, int]]:
    """The sweep's grid for an [N, K] weight, the table's own choice first; splits that leave a split
    empty, more than MAX_PROGRAMS programs or more than MAX_SHARED are left out (weight_only: 2-byte tokens).
    block_ns: the channel tiles tried. Below 64 (mma.sync, not wgmma) with 2 or 4 warps and at most 2 splits:
    such tiles are there to need few or no partial sums."""
    out = [decode_config(n, k, weight_only=weight_only)]
    x_bytes = 2 if weight_only else 1
    grid = []
    for block_n in block_ns:
        small = block_n < 64
        grid += itertools.product((block_n,), (128, 256), (1, 2) if small else (1, 2, 4, 8, 16),
                                  (2, 4) if small else (4, 8), (3, 5))
    for block_n, block_k, split, warps, stages in grid:
        k_tiles = triton.cdiv(k, block_k)
        per_split = triton.cdiv(k_tiles, split)
        if per_split * (split - 1) >= k_tiles or triton.cdiv(n, block_n) * split > MAX_PROGRAMS:
            continue
        if warps == 8 and block_n == 64:  # 8 warps need two warpgroups of 64 channels
            continue
        if stages * (block_n + 64 * x_bytes) * block_k > MAX_SHARED:
            continue
        cfg = (block_n, block_k, split, warps, stages)
        if cfg not in out:
            out.append(cfg)
    return out


def sweep(shapes: dict[str, tuple[int, int]], ms: list[int], device: str, timed, seed: int = 0,
          weight_only: bool = False, block_ns: tuple[int, ...] = (64, 128)) -> list[dict]:
    """One row per (projection, m, config): us and weight TB/s; `timed(fn) -> us`. weight_only: fp8w_decode_mm on
    bf16 tokens instead of fp8_decode_mm on FP8 ones. A candidate that fails to compile or launch is a row with
    us NaN and its error, not the end of the sweep."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for name, (n, k) in shapes.items():
        copies = max(1, -(-L2_PASS_BYTES // (n * k))) if device != "cpu" else 1
        weights = [quantize_weight((torch.randn(n, k, generator=g) * 0.02).to(device)) for _ in range(copies)]
        state = {"i": 0}

        def next_w():
            state["i"] = (state["i"] + 1) % copies
            return weights[state["i"]]

        for m in ms:
            x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
            q_x, s_x = quantize_rows(x)
            cublas = timed(lambda: scaled_mm_rows(q_x, s_x, *next_w())) if device != "cpu" else float("nan")
            for i, cfg in enumerate(candidates(n, k, weight_only, block_ns)):
                error = ""
                try:
                    us = timed((lambda: fp8w_decode_mm(x, *next_w(), config=cfg)) if weight_only else
                               (lambda: fp8_decode_mm(q_x, s_x, *next_w(), config=cfg)))
                except Exception as e:  # noqa: BLE001 - Triton's compile errors have no common type
                    us, error = float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                rows.append(dict(projection=name, m=m, n=n, k=k, config=cfg, table=i == 0, us=us,
                                 tb_s=n * k / us / 1e6, cublas_us=cublas, error=error))
        del weights
    return rows


def best_lines(rows: list[dict], launch_table: dict = CONFIGS, table_name: str = "CONFIGS") -> list[str]:
    lines = []
    failed = [r for r in rows if r["us"] != r["us"]]
    rows = [r for r in rows if r["us"] == r["us"]]  # NaN: a candidate that failed
    for key in dict.fromkeys((r["projection"], r["m"]) for r in rows):
        at = [r for r in rows if (r["projection"], r["m"]) == key]
        best, table = min(at, key=lambda r: r["us"]), next(r for r in at if r["table"])
        lines.append(f"{key[0]:>13} m={key[1]:<3} best {best['config']} {best['us']:.2f} us {best['tb_s']:.2f} TB/s; "
                     f"table {table['config']} {table['us']:.2f} us; _scaled_mm {best['cublas_us']:.2f} us")
    lines.append(f"{table_name} (the best summed over the token counts):")
    for name in dict.fromkeys(r["projection"] for r in rows):
        at = [r for r in rows if r["projection"] == name]
        total: dict[tuple, float] = {}
        ms = {r["m"] for r in at}
        for r in at:
            total[r["config"]] = total.get(r["config"], 0.0) + r["us"]
        total = {c: t for c, t in total.items() if sum(r["config"] == c for r in at) == len(ms)}  # timed at every m
        cfg = min(total, key=total.get)
        lines.append(f"    ({at[0]['n']}, {at[0]['k']}): {cfg},  # {name}: {total[cfg]:.1f} us over m "
                     f"{sorted(ms)}; table {launch_table.get((at[0]['n'], at[0]['k']))}")
    lines += [f"failed: {r['projection']} m={r['m']} {r['config']}: {r['error']}" for r in failed]
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--projections", nargs="+", choices=list(SHAPES_7B), default=list(SHAPES_7B))
    ap.add_argument("--m", nargs="+", type=int, default=[1, 16, 32, 64])
    ap.add_argument("--out", help="CSV of every timing")
    ap.add_argument("--activations", choices=("fp8", "bf16"), default="fp8",
                    help="fp8: fp8_decode_mm on per-token FP8 rows; bf16: the weight-only fp8w_decode_mm")
    ap.add_argument("--block-n", nargs="+", type=int, default=[64, 128], choices=BLOCK_NS,
                    help="channel tiles to try (the table's own launch is always timed)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.fp8_decode_sweep times on a CUDA GPU; none is visible")
    from vlora_kernels.timing import time_op

    rows = sweep({p: SHAPES_7B[p] for p in args.projections}, args.m, "cuda",
                 lambda fn: time_op(fn, warmup=5, repeats=20), weight_only=args.activations == "bf16",
                 block_ns=tuple(args.block_n))
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    wo = args.activations == "bf16"
    print("\n".join(best_lines(rows, W_CONFIGS if wo else CONFIGS, "W_CONFIGS" if wo else "CONFIGS")))


if __name__ == "__main__":
    main()
