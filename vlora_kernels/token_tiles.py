"""Which segment and token tile each program of an ATMM kernel works on: the token axes of the grid.

Two layouts:
    by segment   (segments, ceil(max_seg_len / block_m)): every segment gets as many token
                 tiles as the longest one needs. Exact for equal segments; for a skewed batch
                 (one hot adapter with thousands of tokens beside a tail of short ones) almost
                 every program starts only to exit.
    flat         one axis holding the token tiles of all segments, one after another. A program
                 finds its segment from the running sum of the segments' tile counts (one
                 vector load of seg_len and a prefix sum). Its length is a bound that holds for
                 any metadata of the same sizes, so a CUDA graph may capture it:
                     sum_g ceil(len_g / block_m) <= (T + G * (block_m - 1)) // block_m
                 for G segments holding T tokens in all.

Decode-sized batches keep the by-segment layout: their CUDA graphs already bound it by the
adapter mix (serve/lora/metadata.py), and the lookup would put one more dependent load in
front of every program of a launch whose latency is most of its time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .segments import SegmentMeta

FLAT_MIN_TOKENS = 65  # batches of more tokens may take the flat layout (past the decode buckets)
FLAT_MAX_SEGMENTS = 1024  # every program loads all segments' lengths: beyond this, by segment
# The lookup's width is a compile-time constant: one width for every batch of up to this many
# segments keeps it to one compiled kernel per tiling (a width per power of two would compile
# anew, mid-serving, whenever a batch reached a new one); the masked lanes cost nothing.
SEG_LOOKUP = 128


def flat_tiles(meta: SegmentMeta, block_m: int) -> int:
    """Programs of the flat layout: a bound on the token tiles of any batch of these sizes."""
    return (meta.token_order.shape[0] + meta.num_segments * (block_m - 1)) // block_m


def seg_block(meta: SegmentMeta, block_m: int, flat: bool | None = None) -> int:
    """The kernels' SEG_BLOCK: 0 for the by-segment layout, else the flat layout's lookup width
    (SEG_LOOKUP, or the segments rounded up to a power of two past it).

    flat: None picks the flat layout where it launches fewer programs, for batches past the
    decode sizes; True / False force a layout (tests, benchmarks).
    """
    if flat is None:
        flat = (meta.num_tokens >= FLAT_MIN_TOKENS and meta.num_segments <= FLAT_MAX_SEGMENTS
                and flat_tiles(meta, block_m) < meta.num_segments * triton.cdiv(meta.max_seg_len, block_m))
    if not flat:
        return 0
    if meta.num_segments > FLAT_MAX_SEGMENTS:
        raise ValueError(f"the flat token grid takes at most {FLAT_MAX_SEGMENTS} segments, "
                         f"the batch has {meta.num_segments}")
    return max(SEG_LOOKUP, triton.next_power_of_2(meta.num_segments))


def token_grid(meta: SegmentMeta, block_m: int, block: int) -> tuple[int, int]:
    """The grid's first two axes for SEG_BLOCK `block` (`seg_block`)."""
    if block:
        return flat_tiles(meta, block_m), 1
    return meta.num_segments, triton.cdiv(meta.max_seg_len, block_m)


@triton.jit
def token_tile(seg_len_ptr, n_segments, BLOCK_M: tl.constexpr, SEG_BLOCK: tl.constexpr):
    """(segment, token tile within it) of this program. A flat program past the batch's last
    tile gets the last segment and a tile past its end, so the caller's exit test sends it home."""
    if SEG_BLOCK == 0:
        pid_seg = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:
        pid = tl.program_id(0)
        segs = tl.arange(0, SEG_BLOCK)
        tiles = (tl.load(seg_len_ptr + segs, mask=segs < n_segments, other=0) + BLOCK_M - 1) // BLOCK_M
        ends = tl.cumsum(tiles, 0)
        seg = tl.sum((ends <= pid).to(tl.int32), 0)  # segments wholly before this tile (empty ones too)
        start = tl.sum(tl.where(segs == seg, ends - tiles, 0), 0)
        past = seg >= n_segments  # then pid >= every tile count, so pid itself is past the end
        pid_seg = tl.where(past, n_segments - 1, seg)
        pid_m = tl.where(past, pid, pid - start)
    return pid_seg, pid_m
