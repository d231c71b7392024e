"""Tiling configurations of the ATMM kernels: the space the offline search explores, the
hardware constraints that prune it, the shape key a table is indexed by, and the heuristic
used where no table entry exists.

Four ops are tiled: the two launches of the ATMM op ("shrink", "expand") and two one-launch
variants for decode-sized batches ("fused", `fused.py`; "handoff", `handoff.py`). The heuristic
gives every op a tiling, but only a table entry that measured a one-launch op faster than the two
launches sends a batch to it (`TilingTable.one_launch`; see the note on the fused op below).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

OPS = ("shrink", "expand", "fused", "handoff")
ONE_LAUNCH_OPS = ("fused", "handoff")  # each is the whole LoRA op in one kernel
FUSED_MAX_TOKENS = 64  # the fused op is searched and benchmarked up to this many tokens (decode)
FUSED_MAX_RANK = 128  # it holds a token tile's whole rank in registers (the handoff op too)
HANDOFF_MAX_TOKENS = 64  # decode sizes: the handoff op is searched and run up to this many tokens


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # tokens per tile
    block_n: int  # output columns per tile (shrink: rank columns; expand: output features)
    block_k: int  # reduction step (shrink: input features; expand: rank)
    split_k: int = 1  # shrink only: the reduction split across programs, each writing its own plane of v
    # that the expand adds up as it reads (no atomics)
    num_warps: int = 4
    num_stages: int = 2
    col_tiles: int = 1  # fused and expand: output column tiles one program loops over, reusing the v
    # it computed (fused) or read (expand); tables written before these variants lack it, and the
    # default keeps them loading

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TileConfig.{name}={value}: tiles are powers of two, at least 16")
        for name in ("split_k", "col_tiles"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"TileConfig.{name}={value}: a power of two >= 1")

    def smem_bytes(self, elem_bytes: int = 2, rank: int | None = None) -> int:
        """Shared memory of the pipelined operand tiles (x/v tile plus weight tile per stage).

        rank: the fused op's padded rank: its shrink streams x and A tiles `rank` rows high, and
        its column loop streams B tiles `rank` wide.
        """
        if rank is not None:
            return self.num_stages * ((self.block_m + rank) * self.block_k + self.block_n * rank) * elem_bytes
        return self.num_stages * (self.block_m * self.block_k + self.block_k * self.block_n) * elem_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, entry: dict) -> "TileConfig":
        """From a table entry, ignoring its other fields (such as the measured time); fields
        added since the entry was written take their defaults."""
        missing = [f for f in ("block_m", "block_n", "block_k") if f not in entry]
        if missing:
            raise ValueError(f"tiling table entry {entry} lacks {missing}")
        return cls(**{f: entry[f] for f in cls.__dataclass_fields__ if f in entry})


@dataclass(frozen=True)
class ShapeKey:
    """What the best tiling depends on, bucketed so the table stays small.

    tokens and seg_len are rounded up to powers of two; k and n are exact model dimensions;
    rank is the pool's rank rounded up to a power of two (>= 16).
    """

    op: str
    tokens: int
    seg_len: int
    k: int
    n: int
    rank: int
    slices: int

    def __str__(self) -> str:
        return f"{self.op}|t{self.tokens}|m{self.seg_len}|k{self.k}|n{self.n}|r{self.rank}|s{self.slices}"

    @classmethod
    def parse(cls, text: str) -> "ShapeKey":
        op, *fields = text.split("|")
        values = {f[0]: int(f[1:]) for f in fields}
        return cls(op, values["t"], values["m"], values["k"], values["n"], values["r"], values["s"])


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def shape_key(op: str, num_tokens: int, max_seg_len: int, k: int, n: int, rank: int, slices: int) -> ShapeKey:
    if op not in OPS:
        raise ValueError(f"op {op!r} is not one of {OPS}")
    return ShapeKey(op, next_pow2(num_tokens), next_pow2(max_seg_len), int(k), int(n),
                    max(16, next_pow2(rank)), int(slices))


def _m_tiles(key: ShapeKey, block_m: int) -> int:
    """Token tiles of a batch: about tokens / seg_len segments, each cut into block_m rows."""
    segments = max(1, key.tokens // key.seg_len)
    return segments * -(-key.seg_len // block_m)


def heuristic_config(key: ShapeKey, num_sms: int = 132) -> TileConfig:
    """A sensible tiling without profiling: the whole rank in one tile (each x row read once),
    and enough programs to fill the GPU (split-K when the token tiles alone are too few)."""
    block_m = min(64, max(16, key.seg_len))
    if key.op == "shrink":
        programs = _m_tiles(key, block_m) * key.slices
        split_k = 1
        while programs * split_k < num_sms and key.k // (split_k * 2) >= 256 and split_k < 16:
            split_k *= 2
        return TileConfig(block_m, min(128, key.rank), 128 if key.seg_len <= 64 else 64, split_k, 4, 3)
    if key.op == "fused":
        return TileConfig(block_m, 64, 128, 1, 4, 3, _fused_col_tiles(key, block_m, 64, num_sms))
    if key.op == "handoff":
        return _handoff_key_space(key, num_sms)[0]
    return TileConfig(block_m, 128 if block_m <= 32 else 64, min(64, key.rank), 1, 4, 2)


# The fused op's trade-off. One launch instead of two dependent ones, and v never leaves the
# SM; but each program recomputes v = x_tile @ A[slot].T over the whole K for the output
# columns it covers, so a slice cut into P column groups reads A[slot] (r x K) P times (from
# L2 after the first) and does P times the shrink's arithmetic, and one program streams its
# A alone, at one SM's bandwidth: that read sets the program's floor, and it grows with
# r x K, not with the columns. Its heuristic tiling therefore spreads a slice over enough
# groups to fill the GPU about once, but never more than MAX_FUSED_GROUPS on average over
# the slices (the key knows their total width, not each one's), which bounds the launch's
# shrink work at that many times the two-launch shrink's; each program then loops over
# `col_tiles` column tiles with v in registers.
#
# Measured, the trade-off loses: on an NVIDIA H100 80GB HBM3 on 2026-11-24
# (`vlora bench`'s atmm_fused row against its atmm row; results/kernels/fused_decode_h100/),
# the fused op was slower than the two launches on all 32 decode shapes timed (1, 8, 32, 64
# tokens x ranks 16, 64 x four adapter mixes, hidden 4096): at best 0.81x as fast, typically
# 0.5-0.75x (1 token, rank 16: 10.9 us against 8.1 us; 64 tokens, rank 64, 64 distinct
# adapters: 43.4 us against 35.1 us).
# A heuristic once sent the smallest shapes (<= 16 tokens, a short A stream, such as 1 token
# at rank 16) to the fused op where the table had not measured it, on the estimate that the
# saved launch outweighs the A stream; the measurement refuted it, so it was removed: the
# fused op serves only where the table's entry (written by `vlora tune`, which times it
# against the two halves at the same shape) records it faster, and two launches everywhere else.
MAX_FUSED_GROUPS = 16


def _fused_col_tiles(key: ShapeKey, block_m: int, block_n: int, num_sms: int) -> int:
    groups = max(1, min(MAX_FUSED_GROUPS, num_sms // (_m_tiles(key, block_m) * key.slices)))
    width = -(-key.n // key.slices)  # the mean slice width
    return next_pow2(-(-width // (block_n * groups)))


def config_space(key: ShapeKey, max_smem: int = 227 * 1024, elem_bytes: int = 2) -> list[TileConfig]:
    """Every tiling worth profiling for `key`, within the device's shared memory.

    Pruned by what cannot help: a token tile taller than twice the longest segment only
    computes padding; the rank is never split (each x row is then read once, and no tile is
    wider than the rank); split-K only pays while the grid is too small to fill the GPU
    (decode sizes, and batches of up to 2048 tokens: `_shrink_splits`); the expand's reduction
    is the rank, a handful of steps, so deep pipelines buy nothing there. The fused op's K step
    streams the whole padded rank of A, and a program never spans more columns than the
    projection has.
    """
    m_cap = max(16, min(128, 2 * key.seg_len))
    block_ms = [m for m in (16, 32, 64, 128) if m <= m_cap]
    if key.op == "fused":
        return _fused_space(key, block_ms, max_smem, elem_bytes)
    if key.op == "handoff":
        return _handoff_key_space(key)
    if key.op == "shrink":
        block_ns, block_ks = (min(key.rank, 128),), (64, 128, 256)
        splits, stages = _shrink_splits(key), (2, 3, 4)
    else:
        block_ns, block_ks, splits, stages = (32, 64, 128, 256), (min(key.rank, 64),), (1,), (2, 3)
    out = []
    for m, n, k, s, w, st in itertools.product(block_ms, block_ns, block_ks, splits, (4, 8), stages):
        if key.op == "shrink" and s * k > key.k:
            continue  # a split would get no work
        cfg = TileConfig(m, n, k, s, w, st)
        if cfg.smem_bytes(elem_bytes) <= max_smem:
            out.append(cfg)
    if key.op == "expand":
        out += _expand_column_groups(key, block_ms, max_smem, elem_bytes)
    return out


def _expand_column_groups(key: ShapeKey, block_ms: list[int], max_smem: int, elem_bytes: int) -> list[TileConfig]:
    """Expand tilings whose programs loop over 2-8 column tiles with the token tile's v held
    (`expand._expand_columns`): for prefill-sized batches, where v is otherwise re-read once per
    column tile. Their K step is the whole rank (v is held whole), so the shared-memory bound
    counts B tiles the rank wide."""
    if key.tokens <= FUSED_MAX_TOKENS:
        return []  # decode batches want more programs, not fewer
    out = []
    for m, n, cols, w, st in itertools.product(block_ms, (64, 128), (2, 4, 8), (4, 8), (2, 3)):
        if n * cols > max(n, next_pow2(-(-key.n // key.slices))):
            continue  # column tiles of pure padding
        cfg = TileConfig(m, n, key.rank, 1, w, st, cols)
        if cfg.smem_bytes(elem_bytes) <= max_smem:
            out.append(cfg)
    return out


def _shrink_splits(key: ShapeKey) -> tuple[int, ...]:
    """Split-K factors worth timing: deep splits at decode sizes; at prefill sizes up to 2048
    tokens still up to 8, since one 1024-token segment cut into 16-row tiles gives 64 programs,
    fewer than an H100 has SMs (measured there: the shrink alone at 2.9x its floor, 8.2 us
    against 2.9 us, at split 2; results/kernels/prefill_h100/parts/); longer batches fill the
    GPU with token tiles."""
    if key.tokens <= 256:
        return 1, 2, 4, 8, 16
    return (1, 2, 4, 8) if key.tokens <= 2048 else (1, 2)


def _fused_space(key: ShapeKey, block_ms: list[int], max_smem: int, elem_bytes: int) -> list[TileConfig]:
    out = []
    for m, n, k, cols, w, st in itertools.product(block_ms, (32, 64, 128), (64, 128, 256), (1, 2, 4, 8, 16),
                                                  (4, 8), (2, 3)):
        if n * cols > max(n, next_pow2(key.n)) or k > max(64, next_pow2(key.k)):
            continue  # column tiles or K steps of pure padding
        cfg = TileConfig(m, n, k, 1, w, st, cols)
        if cfg.smem_bytes(elem_bytes, rank=key.rank) <= max_smem:
            out.append(cfg)
    return out


def handoff_space(tokens: int, n_segments: int, seg_len: int, k: int, max_slice: int, n_slices: int,
                  num_sms: int = 132) -> list[TileConfig]:
    """Tilings worth timing for one decode batch of the handoff op: token tiles that fit the
    longest segment, K steps of 128-256 split so that the shrink items number about one to two
    per SM, and expand column tiles of 64-128 in groups of 1-4."""
    out = []
    for block_m in sorted({16, min(64, next_pow2(max(16, seg_len)))}):
        items = n_segments * -(-seg_len // block_m) * n_slices
        for block_k in (128, 256):
            most = 1 << (max(1, k // block_k).bit_length() - 1)  # splits are powers of two (K 3584: 14 steps -> 8)
            for split in sorted({min(most, next_pow2(max(1, num_sms // items))),
                                 min(most, next_pow2(max(1, 2 * num_sms // items)))}):
                for block_n, col_tiles in ((64, 1), (64, 2), (128, 1), (128, 2), (64, 4)):
                    if block_n * col_tiles <= max(64, next_pow2(max_slice)):
                        out.append(TileConfig(block_m, block_n, block_k, split_k=split, col_tiles=col_tiles,
                                              num_warps=4, num_stages=2))
    return list(dict.fromkeys(out))


def _handoff_key_space(key: ShapeKey, num_sms: int = 132) -> list[TileConfig]:
    """`handoff_space` for a table bucket: about tokens / seg_len segments, slices of the mean width."""
    return handoff_space(key.tokens, max(1, key.tokens // key.seg_len), key.seg_len, key.k,
                         -(-key.n // key.slices), key.slices, num_sms)
