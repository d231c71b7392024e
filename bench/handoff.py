"""The one-launch handoff kernel (`kernels/handoff.py`) against the two launches at decode sizes.

    python -m bench.handoff --tokens 1 8 32 64 --ranks 16 64 --out DIR

For each shape (hidden 4096, fp16, 64 adapter slots, the kernel benchmark's adapter mixes), the
two launches at the device table's tiling (`add_lora`, with programmatic dependent launch where
the GPU has it, as the engine runs them) and the handoff kernel over `handoff_space`'s tilings:
a quick pass over all, then the four fastest timed again; the fastest is also timed with roles
by program id instead of tickets (`handoff_by_id_us`, `handoff_add_lora(tickets=False)`).
Before timing, every tiling's result, and the roles-by-id form's at the fastest tiling, is
checked against the two launches' on the same inputs. CUDA-graph medians with L2-cold rotation,
as `vlora bench`; `launch_us` is one one-element add timed the same way, what any launch costs
on this GPU. Writes handoff.csv.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

from kernels.handoff import handoff_add_lora
from kernels.lora import add_lora, configs_for
from kernels.tiling import handoff_space
from kernels.timing import copy_bandwidth_gbs, matmul_tflops, roofline_us, time_op
from kernels.workload import MIXES, LoRAShape, Rotation, floor_cost, longest_segment

from .kernels import _problems
from .results import write_csv

HIDDEN = 4096


def check(problem: tuple, config, tickets: bool = True) -> float:
    """Relative error of the handoff kernel against the two launches on one problem."""
    y, rest = problem[0], problem[1:]
    want = add_lora(y.clone(), *rest)
    got = handoff_add_lora(y.clone(), *rest, config, tickets=tickets)
    return float((got.double() - want.double()).norm() / (want.double() - y.double()).norm().clamp_min(1e-12))


def measure(shape: LoRAShape, l2_bytes: int, num_sms: int, tflops: float, gbs: float, warmup: int,
            repeats: int) -> dict:
    problems = _problems(shape, torch.float16, l2_bytes)
    meta = problems[0][4]
    space = handoff_space(shape.tokens, meta.num_segments, longest_segment(shape.tokens, shape.mix), HIDDEN,
                          max(shape.slices), len(shape.slices), num_sms)
    timed = functools.partial(time_op, warmup=warmup, repeats=repeats)
    def checked(configs, tickets=True) -> float:
        err = max(check(problems[0], c, tickets) for c in configs)
        if err > 1e-2:
            raise SystemExit(f"{shape}: the handoff kernel (tickets={tickets}) differs from the two launches "
                             f"(relative error {err:.3g})")
        return err

    err = checked(space)
    by_ticket = lambda c: Rotation(problems, lambda p: handoff_add_lora(*p, c, tickets=True))  # noqa: E731
    quick = sorted(((time_op(by_ticket(c), warmup=1, repeats=3), c) for c in space), key=lambda q: q[0])
    best = min(((timed(by_ticket(c)), c) for _, c in quick[:4]), key=lambda b: b[0])
    err = max(err, checked([best[1]], tickets=False))  # roles by id: the best tiling only (each form compiles apart)
    by_id = timed(Rotation(problems, lambda p: handoff_add_lora(*p, best[1], tickets=False)))
    two = configs_for(problems[0][1], problems[0][2], meta, problems[0][7])  # the table's two launches, never its one
    atmm = timed(Rotation(problems, lambda p: add_lora(*p, shrink_config=two[0], expand_config=two[1])))
    one = torch.zeros(1, device=problems[0][0].device)
    launch = timed(lambda: one.add_(1))  # one tiny kernel: what any launch costs here, the lower bound
    return dict(tokens=shape.tokens, mix=shape.mix, rank=shape.rank,
                floor_us=round(roofline_us(*floor_cost(shape), tflops, gbs), 2), atmm_us=round(atmm, 2),
                handoff_us=round(best[0], 2), handoff_speedup=round(atmm / best[0], 3), handoff_by_id_us=round(by_id, 2),
                launch_us=round(launch, 2), max_rel_err=f"{err:.2e}",
                tried=len(space), handoff_config=str(best[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if max(args.tokens) > 64:
        sys.exit(f"bench.handoff times decode batches of <= 64 tokens, got --tokens {args.tokens}")
    if not torch.cuda.is_available():
        sys.exit("bench.handoff times CUDA kernels: no CUDA device here")
    props = torch.cuda.get_device_properties(0)
    gbs, tflops = copy_bandwidth_gbs(), matmul_tflops()
    print(f"{props.name}: copy {gbs:.0f} GB/s, matmul {tflops:.0f} TFLOP/s", flush=True)
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    for t, r, mix in itertools.product(args.tokens, args.ranks, args.mixes):
        shape = LoRAShape(t, mix, r, HIDDEN, (HIDDEN,))
        rows.append(measure(shape, props.L2_cache_size, props.multi_processor_count, tflops, gbs, args.warmup,
                            args.repeats))
        print(rows[-1], flush=True)
        write_csv(args.out / "handoff.csv", rows)  # after every shape: a run stopped early keeps its rows
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
