"""The warm-up's sweep of the LoRA kernels: every variant a live step can need, compiled before ready.

Triton compiles ATMM's shrink and expand once per variant: the tiling the table gives the step's
token bucket and longest-segment bucket (vlora_kernels/table.py), the token grid's layout (by segment or
flat, vlora_kernels/token_tiles.py), a mixed-in adapter or none, and the segment count as Triton
specialises an integer (1, a multiple of 16, any other). The warm-up's waves reach only the
pairs of buckets their own batches make. On an H100, 28 cameras on a cold server met four more
variants in their first 3 s; each compile stalled a step carrying every camera's chunk, and the
backlog took the rest of the first 10 s to drain (p95 2.9 s against 0.39 s warm; with the same
kernels already on disk, 0.38 s).

So the warm-up also sweeps: for each LoRA'd projection kind, made-up batches over every token
bucket up to `max_tokens_per_step`, every longest-segment bucket below it, 1, 2 and 16 segments,
without and (where the engine may merge) with a mixed-in adapter, each in every token-grid layout
the shrink and the expand can take at those sizes. Only one batch per distinct variant (`variant`,
read from the table on the host) is run, on scratch tensors, with the operator's own launches: the
pool and the weights are only read. A test draws live-like batches and checks that each needs only
swept variants.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import torch

from vlora_kernels import NO_LORA, SegmentMeta, TilingTable, add_lora, build_segments, configs_for, one_launch_for
from vlora_kernels.lora import default_table
from vlora_kernels.tiling import next_pow2
from vlora_kernels.token_tiles import FLAT_MIN_TOKENS, seg_block

SEGMENT_COUNTS = (1, 2, 16)  # one of each class Triton compiles apart: 1, a multiple of 16, any other


def _seg_class(n: int) -> int:
    return 1 if n == 1 else 16 if n % 16 == 0 else 0


def variant(lora_a: torch.Tensor, meta: SegmentMeta, slices: tuple[int, ...], table: TilingTable,
            flats: tuple[bool, bool] | None = None) -> tuple:
    """What decides which compiled kernels the LoRA operator launches for this batch and layer: the
    one-launch op and its tiling, or the two launches' tilings, each with its token grid's layout
    (`flats`: forced (shrink, expand) layouts; None: as the operator picks them), the mixture, and the
    segment count's class. Equal keys, equal compiled kernels."""
    segs, mix = _seg_class(meta.num_segments), meta.mix_slot is not None
    one = one_launch_for(None, lora_a, meta, slices, table)
    if one is not None:
        return ("one", one[0], str(one[1]), segs)
    shrink_cfg, expand_cfg = configs_for(None, lora_a, meta, slices, table)
    if flats is None:
        flats = (bool(seg_block(meta, shrink_cfg.block_m)), bool(seg_block(meta, expand_cfg.block_m)))
    return ("two", str(shrink_cfg), flats[0], str(expand_cfg), flats[1], mix, segs)


def layouts(meta: SegmentMeta, block_ms: tuple[int, int], slots: int, max_tokens: int) -> list[tuple[bool, bool]]:
    """The (shrink, expand) token-grid layouts live batches of `meta`'s buckets (tokens, longest
    segment), segment-count class and mixture can take, given the two launches' block_m.

    The operator picks the flat grid where it launches fewer programs (token_tiles.seg_block): for G
    segments of T' tokens in all, the longest of L, with block_m b, that is T' < G * (b * (c - 1) + 1),
    c = ceil(L / b), and never below FLAT_MIN_TOKENS tokens. So over every G of the class that fits the
    pool (a mixture adds a segment of tokens of no adapter), every L of the bucket and every T' from
    L + G - 1 to G * L, each layout pair whose T' interval is not empty is reachable."""
    tokens, longest = (next_pow2(meta.num_tokens), next_pow2(meta.max_seg_len))
    t_max = min(tokens, max_tokens)
    if t_max < FLAT_MIN_TOKENS or meta.num_segments == 1:
        return [(False, False)]
    cls = _seg_class(meta.num_segments)
    counts = [g for g in range(2, slots + 1) if _seg_class(g) == cls]
    lens = np.arange(longest // 2 + 1 if longest > 1 else 1, longest + 1)
    found = set()
    for g in counts:
        lo, hi = lens + g - 1, np.minimum(g * lens, t_max)
        ok = lo <= hi
        th = [g * (b * (-(-lens // b) - 1) + 1) for b in block_ms]  # flat iff T' < th
        for fs, fe in itertools.product((False, True), repeat=2):
            low, high = lo.copy(), hi.copy()  # the T' that give this pair
            for flat, t in ((fs, th[0]), (fe, th[1])):
                if flat:
                    high = np.minimum(high, t - 1)
                else:
                    low = np.maximum(low, t)
            if np.any(ok & (low <= high)):
                found.add((fs, fe))
    return sorted(found)


def block_ms(lora_a: torch.Tensor, meta: SegmentMeta, slices: tuple[int, ...], table: TilingTable) -> tuple[int, int]:
    """The (shrink, expand) block_m of the two launches for this batch's buckets."""
    shrink_cfg, expand_cfg = configs_for(None, lora_a, meta, slices, table)
    return shrink_cfg.block_m, expand_cfg.block_m


def sweep_batches(max_tokens: int, slots: int, mixture: bool = True) -> Iterator[tuple[list[int], int | None]]:
    """(slot ids, mixed-in slot or None) of the made-up batches: every (token bucket, longest-segment
    bucket) pair up to `max_tokens`, each with the segment counts of SEGMENT_COUNTS that fit the pool's
    `slots` and the batch, without and (`mixture`) with a mixed-in adapter (slot 0; then the batch's own
    adapters take slots 1, 2, ...)."""
    t = 1
    while True:
        total = min(t, max_tokens)
        s = 1
        while s <= t:
            for mix in (None, 0) if mixture else (None,):
                for g in SEGMENT_COUNTS:
                    lens = _fit(s, g, total)
                    if g > slots - (mix is not None) or lens is None:
                        continue
                    first = 0 if mix is None else 1
                    ids = [first + i for i, n in enumerate(lens) for _ in range(n)]
                    yield ids + [NO_LORA] * (total - len(ids)), mix
            s *= 2
        if t >= max_tokens:
            return
        t *= 2


def _fit(s: int, g: int, total: int) -> list[int] | None:
    """g segment lengths, the longest in bucket s (its top, else its bottom, s // 2 + 1) and the others
    one token each, within `total` tokens; None if they do not fit."""
    for longest in dict.fromkeys((s, s // 2 + 1 if s > 1 else 1)):
        if longest + g - 1 <= total:
            return [longest] + [1] * (g - 1)
    return None


def sweep_lora_kernels(engine) -> int:
    """Runs one made-up batch per variant per LoRA'd projection kind (ATMM only); returns the batches
    run. The engine's step loop must not be running elsewhere."""
    lora = getattr(engine, "lora", None)
    if lora is None or lora.configured_backend != "triton" or not lora.layers:
        return 0
    device = lora.device
    table = default_table(device.index or 0) if device.type == "cuda" else TilingTable("cpu")
    max_tokens = engine.config.max_tokens_per_step
    layers = {}
    for layer in lora.layers:  # every layer of a kind has its shapes: one stands for all
        layers.setdefault(layer.kind, layer)
    ran, mixture = 0, _may_merge(engine)
    with torch.no_grad():
        for layer in layers.values():
            x = torch.zeros(max_tokens, layer.in_features, dtype=layer.lora_a.dtype, device=device)
            y = torch.zeros(max_tokens, sum(layer.slices), dtype=layer.lora_a.dtype, device=device)
            seen, slots = set(), layer.lora_a.shape[1]
            for ids, mix in sweep_batches(max_tokens, slots, mixture):
                meta = build_segments(ids, device, mix_slot=mix)
                for flats in layouts(meta, block_ms(layer.lora_a, meta, layer.slices, table), slots, max_tokens):
                    key = variant(layer.lora_a, meta, layer.slices, table, flats)
                    if key not in seen:
                        seen.add(key)
                        _launch(layer, x[:len(ids)], y[:len(ids)], meta, table, flats)
                        ran += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return ran


def _may_merge(engine) -> bool:
    """Whether the weights may come to hold an adapter (then steps run mixture batches): under any
    policy but fcfs and unmerge_only. Under fcfs only a hand-set mode (`Engine.set_mode`) merges; its
    first mixture steps then compile their kernels, which the compile watch logs. Skipping them halves
    the sweep for an engine that never merges."""
    return engine.config.policy not in ("fcfs", "unmerge_only") or engine.planner.mode.kind != "unmerge"


def _launch(layer, x, y, meta: SegmentMeta, table: TilingTable, flats: tuple[bool, bool]) -> None:
    """The operator's launches for this batch as `LoRALinear.forward` makes them, with the grid layouts
    given: programmatic dependent launch where `add_lora` uses it, none where the shrink runs beside
    the base matmul (`add_lora_beside`); a one-launch op where the table picks one (no grid layout)."""
    add_lora(y, x, layer.lora_a, layer.lora_b, meta, layer.ranks, layer.scales, layer.slices, table=table,
             pdl=False if layer.overlap_shrink else None, flat=flats)
