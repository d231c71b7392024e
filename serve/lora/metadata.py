"""Per-step adapter metadata: which pool slot each token uses, grouped into segments once per step.

The model runner builds one `LoraBatch` per forward from the scheduled sequences (their
adapters' slots are known on the host, so building costs no device sync) and puts it in the
step context; every LoRA layer of the forward reads the same one. `op` is the LoRA operator
of the step, with one signature for both implementations:

    op(y, x, lora_a, lora_b, segments, ranks, scales, slices)      # y += LoRA(x), in place

    "triton": vlora_kernels.add_lora (ATMM: two launches per projection whatever the adapter mix, or
              one launch (fused or handoff) for small decode batches only where the tiling table
              measured it faster; needs fp16/bf16 activations; on CPU it runs in the Triton
              interpreter)
    "torch":  vlora_kernels.lora_reference (per segment and slice in fp32, rounded once into y:
              PEFT's arithmetic; the CPU engine's path)
    "einsum": vlora_kernels.lora_einsum (dLoRA's operator: every token's adapter gathered, contracted
              with einsum; eager, so steps that use it are never graph replays)

CUDA-graph decode replays kernels whose arguments are fixed at capture, so `LoraGraphBuffers`
holds the segment metadata in fixed-size device buffers: a batch of b tokens in the graph of
bucket bs is padded to bs tokens and min(bs, slots) segments (padding segments have length
0 and exit at once), and each replay first copies the step's metadata into the buffers.

That padding sizes the kernels' grids for any mix (bs segments of up to bs tokens), so a bucket
may also hold graphs for narrower mixes: at most s adapters (`segments`) and at most n tokens
per adapter (`seg_len`). Such a graph launches s x ceil(n / block_m) token tiles instead of
bs x ceil(bs / block_m), and its tiling is the table's for n tokens per adapter; `graph_variants`
lists a bucket's graphs and `pick_variant` the tightest one that holds a step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from vlora_kernels import NO_LORA, SegmentMeta, add_lora, build_segments, lora_einsum, lora_reference

OPS: dict[str, Callable] = {"triton": add_lora, "torch": lora_reference, "einsum": lora_einsum}


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto" -> "triton" on a GPU with fp16/bf16 weights, "torch" otherwise; explicit names are checked."""
    if name == "auto":
        return "triton" if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) else "torch"
    if name not in OPS:
        raise ValueError(f"lora_backend {name!r} is not one of auto, {', '.join(OPS)}")
    if name == "triton" and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"lora_backend='triton' needs float16 or bfloat16 weights, the model is {dtype}; "
                         "use lora_backend='torch' (or 'auto') for float32")
    return name


class LoraBatch:
    """slot_ids: the pool slot of every token of the step (host; -1 = no LoRA); segments: the
    tokens grouped by slot on the device, built on first use (a graph replay only needs slot_ids)."""

    def __init__(self, slot_ids: tuple[int, ...], device: torch.device | str, op: Callable,
                 segments: SegmentMeta | None = None):
        self.slot_ids, self.device, self.op = slot_ids, device, op
        if segments is not None:
            self.__dict__["segments"] = segments

    @functools.cached_property
    def segments(self) -> SegmentMeta:
        return build_segments(self.slot_ids, self.device)


def build_lora_batch(slot_ids: list[int], device: torch.device, backend: str) -> LoraBatch | None:
    """The step's metadata, or None when no token uses an adapter (layers then skip LoRA entirely)."""
    if all(s == NO_LORA for s in slot_ids):
        return None
    return LoraBatch(tuple(slot_ids), device, OPS[backend])


class LoraGraphBuffers:
    """Fixed device buffers of segment metadata for graphs captured up to `max_batch` tokens."""

    def __init__(self, max_batch: int, num_slots: int, device: torch.device, backend: str):
        if backend != "triton":
            raise ValueError("CUDA-graph LoRA needs the triton backend (the torch path reads host metadata)")
        self.num_slots = num_slots
        self.op = OPS[backend]
        self.token_order = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.seg_slot = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.seg_start = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.seg_len = torch.zeros(max_batch, dtype=torch.int32, device=device)  # all 0: nothing runs

    def num_segments(self, bs: int) -> int:
        return min(bs, self.num_slots)

    def static_batch(self, bs: int, max_seg_len: int | None = None, max_segments: int | None = None) -> LoraBatch:
        """The LoraBatch a bucket-`bs` graph is captured with: views of the buffers, padded sizes.

        max_seg_len: the most tokens any one adapter of a replayed step may have (default bs: any
        mix). It keys the tiling and sizes the grid along tokens. max_segments: the most adapters
        a replayed step may use (default min(bs, slots): any mix); it sizes the grid along
        segments. A replay past either bound would leave tokens out: `pick_variant` picks the graph."""
        g = self.num_segments(bs)
        g = g if max_segments is None else min(g, max_segments)
        bound = bs if max_seg_len is None else min(bs, max_seg_len)
        meta = SegmentMeta(self.token_order[:bs], self.seg_slot[:g], self.seg_start[:g], self.seg_len[:g],
                           num_tokens=bs, num_segments=g, max_seg_len=bound, host_segments=())
        return LoraBatch((), self.token_order.device, self.op, meta)

    def load(self, slot_ids: tuple[int, ...], bs: int) -> tuple[int, int]:
        """Writes the metadata of b = len(slot_ids) <= bs tokens into the bucket-`bs` buffers;
        returns the step's (adapters, longest segment) for `pick_variant`. The real segments come
        first in the buffers, so a graph over the first s segments sees all of a step with <= s."""
        g = self.num_segments(bs)
        meta = build_segments(slot_ids, "cpu", max_segments=g, max_tokens=bs)
        self.write(meta, bs, g)
        return len(meta.host_segments), max((n for _, _, n in meta.host_segments), default=0)

    def write(self, meta: SegmentMeta, bs: int, g: int) -> None:
        self.token_order[:bs].copy_(meta.token_order, non_blocking=True)
        self.seg_slot[:g].copy_(meta.seg_slot, non_blocking=True)
        self.seg_start[:g].copy_(meta.seg_start, non_blocking=True)
        self.seg_len[:g].copy_(meta.seg_len, non_blocking=True)


def graph_variants(bs: int, g: int, segments: tuple[int, ...] = (), seg_lens: tuple[int, ...] = ()
                   ) -> list[tuple[int, int]]:
    """The (adapters, tokens per adapter) bounds of bucket bs's LoRA graphs: every pair of a bound
    from `segments` (below g, the bucket's padded segment count) or g, and one from `seg_lens`
    (below bs) or bs. (g, bs), which admits any mix, is always there and comes last."""
    ss = sorted({s for s in segments if 1 <= s < g}) + [g]
    ns = sorted({n for n in seg_lens if 1 <= n < bs}) + [bs]
    return [(s, n) for s in ss for n in ns if (s, n) != (g, bs)] + [(g, bs)]


def pick_variant(segments: int, longest: int, variants: list[tuple[int, int]]) -> tuple[int, int]:
    """The variant that holds a step of `segments` adapters, the largest with `longest` tokens,
    and launches the fewest token tiles (s x n; on a tie the shorter segments, whose tiling was
    searched for the narrower mix). The last variant admits any step of its bucket."""
    fits = [(s, n) for s, n in variants if segments <= s and longest <= n]
    return min(fits, key=lambda v: (v[0] * v[1], v[1]))
