"""Offline tiling search: profile every configuration of the space on every shape bucket that
occurs and record the fastest in the GPU's table (`vlora_kernels/tables/<gpu>.json`).

Each tiling is judged by the time of the whole op (shrink + expand) with the other half at
the table's choice. Decode-sized shapes (up to FUSED_MAX_TOKENS tokens) also search the two
one-launch kernels ("fused", "handoff"), after both halves; each of their entries also records
the two launches at the table's tilings timed in the same run ("two_launch_us"), so the table
can tell which wins from times of one run (`TilingTable.one_launch`). Resumable: the table is saved
after each shape, and a rerun skips the shapes already in it.
Compilation of the candidate kernels runs first, in parallel worker processes that fill
Triton's on-disk cache, so profiling then measures only run time.
"""

from __future__ import annotations

import csv
import functools
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path

import torch

from .fused import fused_add_lora
from .handoff import handoff_add_lora
from .lora import add_lora
from .segments import build_segments
from .table import TABLE_DIR, TilingTable, device_slug
from .tiling import (FUSED_MAX_RANK, FUSED_MAX_TOKENS, HANDOFF_MAX_TOKENS, ONE_LAUNCH_OPS, TileConfig,
                     config_space, shape_key)
from .timing import copy_bandwidth_gbs, time_op
from .workload import DTYPES, MIXES, LoRAShape, Rotation, copies_to_defeat_cache, floor_cost, longest_segment, make_problem



@dataclass
class SearchJob:
    tokens: list[int]
    mixes: list[str]
    ranks: list[int]
    hidden_sizes: list[int]
    dtype: str = "float16"
    warmup: int = 3
    repeats: int = 7
    workers: int = 16
    table: str | None = None  # default: vlora_kernels/tables/<gpu>.json
    log: str | None = None  # CSV of every timing taken
    layouts: list = field(default_factory=list)  # more (in_features, out slice widths) than hidden squares
    # The ops searched; leaving out "fused" skips that one-launch kernel's large space (add_lora
    # then keeps the two launches on those buckets, as on any bucket the table lacks, unless
    # another one-launch op's entry wins there). ["handoff"] alone adds that op to a table that
    # has the halves already.
    ops: list = field(default_factory=lambda: list(OPS))
    compile_batch: int = 12  # keys compiled ahead of their timing at a time (0: all before any is timed)
    # Ops whose buckets are searched again though the table has them (after their space grew);
    # each keeps its old entry until the new search of it is recorded, so a stopped run loses nothing.
    redo: list = field(default_factory=list)


OPS = ("shrink", "expand", "fused", "handoff")


def job_layouts(job: SearchJob) -> list[tuple[int, tuple[int, ...]]]:
    """(K, slices) of every projection searched: hidden x hidden squares plus the given layouts."""
    out = [(h, (h,)) for h in job.hidden_sizes]
    for k, slices in job.layouts:
        if (int(k), tuple(int(w) for w in slices)) not in out:
            out.append((int(k), tuple(int(w) for w in slices)))
    return out


def search_keys(job: SearchJob) -> dict:
    """key -> representative shape, for every (op, bucket) the job's grid produces."""
    unknown = set(job.ops) - set(OPS)
    if unknown or not {"shrink", "expand"} <= set(job.ops) and {"shrink", "expand"} & set(job.ops):
        raise ValueError(f"tune.ops {list(job.ops)}: choose from {list(OPS)}, shrink and expand together "
                         "(each half is timed behind the other)")
    keys = {}
    for t in job.tokens:
        for mix in job.mixes:
            seg = longest_segment(t, mix)
            for r in job.ranks:
                for k, slices in job_layouts(job):
                    limits = {"fused": t <= FUSED_MAX_TOKENS and r <= FUSED_MAX_RANK,
                              "handoff": t <= HANDOFF_MAX_TOKENS and r <= FUSED_MAX_RANK}
                    for op in (o for o in OPS if o in job.ops and limits.get(o, True)):
                        keys.setdefault(shape_key(op, t, seg, k, sum(slices), r, len(slices)),
                                        LoRAShape(t, mix, r, k, slices))
    return keys


def pending_keys(job: SearchJob, table: TilingTable) -> dict:
    """The job's keys still to search: those the table lacks, and every key of a `redo` op."""
    if set(job.redo) - set(job.ops):
        raise ValueError(f"tune.redo {list(job.redo)}: only ops the run searches ({list(job.ops)})")
    return {k: s for k, s in search_keys(job).items() if str(k) not in table.entries or k.op in job.redo}


def _fused_step(cfg: TileConfig, problem):
    return fused_add_lora(*problem, cfg)


def _handoff_step(cfg: TileConfig, problem):
    return handoff_add_lora(*problem, cfg)  # roles as the engine's launches take them (`roles_by_id`)


ONE_LAUNCH_STEPS = {"fused": _fused_step, "handoff": _handoff_step}


def _problem(shape: LoRAShape, dtype, seed=0):
    y, x, lora_a, lora_b, slot_ids, ranks, scales = make_problem(shape, dtype, "cuda", seed)
    return y, x, lora_a, lora_b, build_segments(slot_ids, "cuda"), ranks, scales, shape.slices


def _compile_chunk(args) -> int:
    """Worker: launch each (op, config) once on a small problem of the same shape class."""
    work, dtype_name = args
    dtype = DTYPES[dtype_name]
    problem, layout = None, None
    for item in work:
        op, cfg, shape = item
        if _layout(item) != layout:  # items come sorted by layout: one problem each
            layout = _layout(item)
            problem = _problem(LoRAShape(16, "distinct", *layout), dtype)
        # The halves through add_lora, so each compiles as add_lora launches it (with or without PDL).
        partner = TileConfig(16, 64, 16) if op == "shrink" else TileConfig(16, min(128, max(16, shape.rank)), 64)
        (ONE_LAUNCH_STEPS[op] if op in ONE_LAUNCH_STEPS else _coupled_step(op, partner))(cfg, problem)
    torch.cuda.synchronize()
    return len(work)


def _layout(item: tuple) -> tuple:
    """(rank, in_features, slices) of a compile item (op, tiling, shape): what its problem needs."""
    return item[2].rank, item[2].k, item[2].slices


def compile_chunks(work: list, workers: int) -> list[list]:
    """The compile work split across `workers` processes.

    Triton caches compiled kernels per process, and one (op, tiling) launched on another layout
    mostly compiles to the same kernel (the specialization differs only where a divisibility
    flag or the rank's power of two does). So every item of one (op, tiling) goes to the same
    worker, where the later ones are cache hits, instead of several workers compiling the same
    kernel at once; a worker's items are sorted by layout so that consecutive ones share a problem.
    """
    groups: dict[tuple, list] = {}
    for item in work:
        groups.setdefault((item[0], item[1]), []).append(item)
    chunks: list[list] = [[] for _ in range(max(1, workers))]
    for i, items in enumerate(groups.values()):
        chunks[i % len(chunks)].extend(items)
    for chunk in chunks:
        chunk.sort(key=_layout)
    return [c for c in chunks if c]


def precompile(work: list, dtype_name: str, workers: int, pool: ProcessPoolExecutor | None) -> None:
    """Compiles `work` in the `workers` processes of `pool` (kept across calls by `run_search`), or
    in this process without one."""
    if pool is None:
        for chunk in compile_chunks(work, 1):
            _compile_chunk((chunk, dtype_name))
        return
    done = 0
    for n in pool.map(_compile_chunk, [(c, dtype_name) for c in compile_chunks(work, workers)]):
        done += n
        print(f"\rcompiled {done}/{len(work)} kernels", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)


def compile_batches(todo: dict, spaces: dict, batch: int) -> list[tuple[list, list]]:
    """(keys, compile work) in search order, `batch` keys at a time (0: all at once). The work of a
    batch is every (op, tiling, layout) its keys need that no earlier batch compiled, so a run
    stopped part way has recorded the buckets it got to instead of still compiling."""
    keys = list(todo)
    batch = batch if batch > 0 else max(1, len(keys))
    seen: set = set()
    out = []
    for start in range(0, len(keys), batch):
        part, work = keys[start:start + batch], []
        for key in part:
            shape = todo[key]
            for cfg in spaces[key]:
                item = (key.op, cfg, shape)
                ident = (key.op, cfg, *_layout(item))
                if ident not in seen:
                    seen.add(ident)
                    work.append(item)
        out.append((part, work))
    return out


def _coupled_step(op: str, partner: TileConfig):
    """One timed step for tuning `op`: the whole LoRA op with the other half at `partner`.

    The halves are coupled (a shrink split into more K planes leaves more partial sums for
    the expand to add up), so each tiling is judged by what the whole op costs with it. The
    shrink is searched first; the expand is then tuned behind the shrink the table chose.
    """

    def step(cfg: TileConfig, problem):
        shrink_cfg, expand_cfg = (cfg, partner) if op == "shrink" else (partner, cfg)
        return add_lora(*problem, shrink_config=shrink_cfg, expand_config=expand_cfg)  # as the engine launches it

    return step


def _step_for(key, table: TilingTable):
    """The timed step of `key`'s op: a one-launch kernel alone is the whole op."""
    if key.op in ONE_LAUNCH_STEPS:
        return ONE_LAUNCH_STEPS[key.op]
    return _coupled_step(key.op, table.lookup(replace(key, op="expand" if key.op == "shrink" else "shrink")))


def run_search(job: SearchJob) -> TilingTable:
    props = torch.cuda.get_device_properties(0)
    path = Path(job.table) if job.table else TABLE_DIR / f"{device_slug(props.name)}.json"
    table = TilingTable.load(path) if path.exists() else TilingTable(props.name, {}, props.multi_processor_count)
    dtype = DTYPES[job.dtype]
    max_smem = getattr(props, "shared_memory_per_block_optin", 227 * 1024)
    todo = pending_keys(job, table)
    print(f"{props.name}: {len(todo)} shapes to search ({len(table.entries)} in {path}, "
          f"redo: {list(job.redo) or 'none'})", file=sys.stderr)
    spaces = {k: config_space(k, max_smem) for k in todo}
    workers = min(job.workers, os.cpu_count() or 1)
    gbs = copy_bandwidth_gbs()
    log = open(job.log, "a", newline="") if job.log else None
    writer = csv.writer(log) if log else None
    pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn")) if workers > 1 and todo else None
    i = 0
    try:
        for keys, work in compile_batches(todo, spaces, job.compile_batch):
            start = time.perf_counter()
            precompile(work, job.dtype, workers, pool)
            print(f"compiled {len(work)} kernels for {len(keys)} shapes in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr)
            for key in keys:
                i += 1
                shape = todo[key]
                best, timed, two = _search_one(key, shape, spaces[key], table, dtype, props.L2_cache_size, job)
                if writer:
                    writer.writerows([props.name, str(key), *cfg.to_dict().values(), f"{us:.3f}"] for us, cfg in timed)
                table.record(key, best[1], best[0], two_launch_us=two)
                table.save(path)
                floor = floor_cost(shape)[1] / (gbs * 1e3)
                versus = "" if two is None else f", two launches {two:.1f} us"
                print(f"[{i}/{len(todo)}] {key}: whole op {best[0]:.1f} us{versus} (memory floor {floor:.1f} us) "
                      f"{best[1]}", file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
        if log:
            log.close()
    return table


def _search_one(key, shape: LoRAShape, space: list, table: TilingTable, dtype, l2_bytes: int, job: SearchJob):
    """((us, tiling) of the fastest, [(us, tiling)] of the quick pass, the two launches' us at the
    table's tilings for a one-launch op, else None) for one bucket."""
    problems = [_problem(shape, dtype, seed) for seed in range(copies_to_defeat_cache(shape, l2_bytes))]
    step = _step_for(key, table)
    timed = []
    for cfg in space:  # a quick pass over the whole space ...
        timed.append((time_op(Rotation(problems, functools.partial(step, cfg)), warmup=1, repeats=3), cfg))
    best = (float("inf"), None)
    for _, cfg in sorted(timed, key=lambda t: t[0])[:5]:  # ... then the front runners, timed properly
        us = time_op(Rotation(problems, functools.partial(step, cfg)), warmup=job.warmup, repeats=job.repeats)
        best = min(best, (us, cfg), key=lambda b: b[0])
    two = None
    if key.op in ONE_LAUNCH_OPS:  # what it must beat, timed now, beside it (`TilingTable.one_launch`)
        pair = [table.lookup(replace(key, op=op)) for op in ("shrink", "expand")]
        two = time_op(Rotation(problems, lambda p: add_lora(*p, shrink_config=pair[0], expand_config=pair[1])),
                      warmup=job.warmup, repeats=job.repeats)
    return best, timed, two


__all__ = ["SearchJob", "run_search", "search_keys", "MIXES"]
