"""Tiling configurations of the ATMM kernels: the space the offline search explores, the
hardware constraints that prune it, the shape key a table is indexed by, and the heuristic
used where no table entry exists.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

OPS = ("shrink", "expand")


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # tokens per tile
    block_n: int  # output columns per tile (shrink: rank columns; expand: output features)
    block_k: int  # reduction step (shrink: input features; expand: rank)
    split_k: int = 1  # shrink only: the reduction split across programs, each writing its own plane of v
    # that the expand adds up as it reads (no atomics)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TileConfig.{name}={value}: tiles are powers of two, at least 16")
        if self.split_k < 1 or self.split_k & (self.split_k - 1):
            raise ValueError(f"TileConfig.split_k={self.split_k}: a power of two >= 1")

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        """Shared memory of the pipelined operand tiles (x/v tile plus weight tile per stage)."""
        return self.num_stages * (self.block_m * self.block_k + self.block_k * self.block_n) * elem_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, entry: dict) -> "TileConfig":
        """From a table entry, ignoring its other fields (such as the measured time)."""
        return cls(**{f: entry[f] for f in cls.__dataclass_fields__})


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
    return TileConfig(block_m, 128 if block_m <= 32 else 64, min(64, key.rank), 1, 4, 2)


def config_space(key: ShapeKey, max_smem: int = 227 * 1024, elem_bytes: int = 2) -> list[TileConfig]:
    """Every tiling worth profiling for `key`, within the device's shared memory.

    Pruned by what cannot help: a token tile taller than twice the longest segment only
    computes padding; the rank is never split (each x row is then read once, and no tile is
    wider than the rank); split-K only pays while the grid is too small to fill the GPU
    (decode-sized token counts); the expand's reduction is the rank, a handful of steps, so
    deep pipelines buy nothing there.
    """
    m_cap = max(16, min(128, 2 * key.seg_len))
    block_ms = [m for m in (16, 32, 64, 128) if m <= m_cap]
    if key.op == "shrink":
        block_ns, block_ks = (min(key.rank, 128),), (64, 128, 256)
        splits, stages = ((1, 2, 4, 8, 16) if key.tokens <= 256 else (1, 2)), (2, 3, 4)
    else:
        block_ns, block_ks, splits, stages = (32, 64, 128, 256), (min(key.rank, 64),), (1,), (2, 3)
    out = []
    for m, n, k, s, w, st in itertools.product(block_ms, block_ns, block_ks, splits, (4, 8), stages):
        if key.op == "shrink" and s * k > key.k:
            continue  # a split would get no work
        cfg = TileConfig(m, n, k, s, w, st)
        if cfg.smem_bytes(elem_bytes) <= max_smem:
            out.append(cfg)
    return out
