"""Per-batch LoRA metadata: the batch's tokens grouped into segments by adapter slot.

Built once per forward pass from the per-token slot ids (which the scheduler knows on the
host, so building costs no device sync) and shared by every LoRA layer of the model. Tokens
are ordered by slot, so each segment holds all tokens of one adapter and the adapter's
weights are read once per tile of tokens, however the adapter's requests are interleaved
in the batch. Slot -1 means "no LoRA": such tokens belong to no segment and are never touched.

Mixture (deLoRA) batches carry a second adapter, `mix_slot`, applied with its scale negated to
every token of every segment: y += dW_own - dW_mix in the same launches, as one problem of rank
r_own + r_mix. Tokens whose own part is nothing (no adapter) while the mixed-in part applies
have slot `MIX_ONLY` (-2) and form a segment of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

NO_LORA = -1
MIX_ONLY = -2  # a token with no adapter of its own that still takes the mixed-in -dW (mixture mode)


@dataclass(frozen=True)
class SegmentMeta:
    token_order: torch.Tensor  # int32 [T_lora]: token indices sorted by slot (slot -1 left out)
    seg_slot: torch.Tensor  # int32 [G]: adapter slot of each segment
    seg_start: torch.Tensor  # int32 [G]: where each segment starts in token_order
    seg_len: torch.Tensor  # int32 [G]: tokens in each segment (0 for padding segments)
    num_tokens: int  # rows of x and y, LoRA'd or not
    num_segments: int  # G, the grid size along segments (>= the real count when padded)
    max_seg_len: int  # bound on seg_len, the grid size along tokens
    host_segments: tuple[tuple[int, int, int], ...]  # (slot, start, length) of the real segments, host side
    mix_slot: torch.Tensor | None = None  # int32 [1]: the slot subtracted from every segment (mixture)
    host_mix_slot: int = NO_LORA  # the same, host side (-1: no mixture)

    @property
    def device(self) -> torch.device:
        return self.token_order.device

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(slot for slot, _, _ in self.host_segments)


def build_segments(slot_ids: Sequence[int] | np.ndarray | torch.Tensor, device: str | torch.device = "cpu",
                   max_segments: int | None = None, max_tokens: int | None = None,
                   mix_slot: int | None = None) -> SegmentMeta:
    """Groups tokens by adapter slot.

    slot_ids: one slot per token (-1 = no LoRA). A device tensor is copied to the host first
    (a sync); pass a host list or array in the serving loop.
    max_segments / max_tokens: pad the metadata to fixed sizes so one CUDA graph captured with
    them serves every batch that fits (padding segments have length 0 and do nothing).
    mix_slot: a mixture batch: every segment also adds -dW of this slot (then slot -2, MIX_ONLY,
    is allowed: tokens that take only that part).
    """
    ids = np.asarray(slot_ids.cpu() if isinstance(slot_ids, torch.Tensor) else slot_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"slot_ids must be one slot per token (1-D), got shape {ids.shape}")
    lowest = NO_LORA if mix_slot is None else MIX_ONLY
    if ids.size and ids.min() < lowest:
        raise ValueError(f"slot_ids must be >= {lowest} (-1 = no LoRA"
                         f"{'' if mix_slot is None else ', -2 = only the mixed-in slot'}), got {int(ids.min())}")
    if mix_slot is not None and mix_slot < 0:
        raise ValueError(f"mix_slot must be a pool slot (>= 0), got {mix_slot}")
    order = np.argsort(ids, kind="stable")  # stable: a segment keeps its tokens' batch order
    order = order[ids[order] != NO_LORA]
    slots, starts, lens = np.unique(ids[order], return_index=True, return_counts=True)
    n_seg, max_len = len(slots), int(lens.max()) if len(lens) else 0
    host_segments = tuple((int(s), int(b), int(n)) for s, b, n in zip(slots, starts, lens))
    if max_segments is not None:
        if n_seg > max_segments:
            raise ValueError(f"batch has {n_seg} adapters but max_segments={max_segments}")
        pad = max_segments - n_seg
        slots, starts, lens = (np.concatenate([a, np.zeros(pad, np.int64)]) for a in (slots, starts, lens))
        n_seg = max_segments
    if max_tokens is not None:
        if max_len > max_tokens or ids.size > max_tokens:
            raise ValueError(f"batch has {ids.size} tokens but max_tokens={max_tokens}")
        max_len = max_tokens
        order = np.concatenate([order, np.zeros(max_tokens - len(order), np.int64)])

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device, non_blocking=True)

    mix = None if mix_slot is None else dev(np.array([mix_slot]))
    return SegmentMeta(dev(order), dev(slots), dev(starts), dev(lens), int(ids.size), n_seg, max_len,
                       host_segments, mix, NO_LORA if mix_slot is None else int(mix_slot))


def check_slots(meta: SegmentMeta, n_slots: int) -> None:
    """Every slot the batch names must be one of the pool's: a kernel would read another
    adapter's memory, or past the pool, without a word. Host-side (the metadata keeps its
    segments there), so it costs no sync."""
    named = [slot for slot in meta.slots if slot >= 0] + ([meta.host_mix_slot] if meta.host_mix_slot >= 0 else [])
    if named and max(named) >= n_slots:
        raise ValueError(f"the batch names adapter slot {max(named)} but the pool has {n_slots} slots")
