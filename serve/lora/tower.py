"""LoRA on the vision tower, served unmerged over the packed rows of one encoder pass.

The Qwen towers encode every image and frame group of a step in one packed pass ([rows, D]),
the CLIP tower a batch of images ([N, 1 + patches, D]). An adapter trained with
`train_vision_tower` adapts the tower's attention and MLP projections (and Qwen's patch
embedding); each item of a pass takes the adapter of the request it belongs to, so one pass
mixes adapters, and one LoRA op call per projection covers all of its rows (ATMM on a GPU,
`vlora_kernels.lora_reference` on CPU: the language model's op and pool slots):

    y = x @ W.T + b                                            # the tower's own projection
    y[rows of item i] += scale[s_i] * x @ A[s_i].T @ B[s_i].T  # s_i: item i's slot; -1: nothing

Forward hooks add the second line to the projections' outputs, so the towers keep their code,
their parameter names and their parity with transformers. A pre-hook on the encoder reads the
items it is given (after tensor parallelism shared them out: each rank sees its own) and looks
each one's slot up by its content key; `TowerLoRA.step(slots_by_key)` names those keys for the
step (the engine keys an item of a tower-adapting request by image and adapter,
serve.engine.encoder_cache.tower_key, so no other adapter's output is ever taken for it). The
rows' segments are built once per pass on the host and shared by every projection.

Only unmerged: the tower's weights are never folded (merge and mixture modes fold the language
model's), so every item pays the LoRA op whatever the engine's mode, and the tower is exact for all.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from vlora_kernels import NO_LORA, build_segments

from .metadata import OPS, LoraBatch
from .pool import AdapterPool
from .tower_shapes import tower_projections


class TowerLoRA:
    """The hooks on one tower and the item slots of the pass it runs."""

    def __init__(self, encoder: nn.Module | None, tower: nn.Module, pool: AdapterPool, backend: str):
        """encoder: the module whose forward takes the items (None: the caller `bind`s each pass itself)."""
        self.pool, self.op = pool, OPS[backend]
        self.slots_by_key: dict[str, int] = {}  # content key -> slot, for the step (`step`)
        self._items: list[tuple[int, int | None]] | None = None  # (slot, rows or None: a batch row) per item
        self._batch: tuple[tuple, LoraBatch | None] | None = None  # (rows shape, batch) of the current pass
        self.handles = [] if encoder is None else [encoder.register_forward_pre_hook(self._begin),
                                                   encoder.register_forward_hook(self._end)]
        for kind, layer, module in tower_projections(tower):
            if kind in pool.kinds:
                self.handles.append(module.register_forward_hook(self._adder(kind, layer)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    @contextmanager
    def step(self, slots_by_key: dict[str, int]):
        """Encoder calls inside take the slot of each item whose content key is named (-1 otherwise)."""
        self.slots_by_key = slots_by_key
        try:
            yield
        finally:
            self.slots_by_key, self._items, self._batch = {}, None, None

    # ---- hooks ----------------------------------------------------------------------------------
    def bind(self, slots: list[int], rows: list[int | None]) -> None:
        """The next passes' items: each one's slot (-1: no LoRA) and pixel rows (None: one batch row, CLIP)."""
        self._items = None if all(s == NO_LORA for s in slots) else list(zip(slots, rows))
        self._batch = None

    def unbind(self) -> None:
        self._items, self._batch = None, None

    def _begin(self, module, args) -> None:
        items = args[0]
        # Qwen items are t * h * w pixel rows of the packed pass; a CLIP item is one batch row
        self.bind([self.slots_by_key.get(it.content_hash, NO_LORA) for it in items],
                  [None if it.grid_thw is None else int(np.prod(it.grid_thw)) for it in items])

    def _end(self, module, args, output) -> None:
        self.unbind()

    def _rows_batch(self, y: torch.Tensor) -> LoraBatch | None:
        """The pass's segments: every row (of [rows, out], or [N, S, out] flattened) with its item's slot.
        Qwen2.5-VL's window order regroups rows within a frame only, so an item keeps its rows' span."""
        if self._items is None:
            return None
        shape = tuple(y.shape[:-1])
        if self._batch is not None and self._batch[0] == shape:
            return self._batch[1]
        slots = np.array([s for s, _ in self._items], dtype=np.int64)
        if y.dim() == 3:  # [N items, S rows, out]
            if shape[0] != len(slots):
                raise RuntimeError(f"the tower ran {shape[0]} images but was given {len(slots)} items")
            ids = np.repeat(slots, shape[1])
        else:
            rows = [r for _, r in self._items]
            if None in rows or sum(rows) != shape[0]:
                raise RuntimeError(f"the tower's pass has {shape[0]} rows but its items have {rows}")
            ids = np.repeat(slots, rows)
        batch = LoraBatch((), y.device, self.op, segments=build_segments(ids, y.device))
        self._batch = (shape, batch)
        return batch

    def _adder(self, kind: str, layer: int):
        lora_a, lora_b, ranks, scales = self.pool.layer_views(kind, layer)
        slices = self.pool.shapes[kind].slices

        def add_lora(module, args, y):
            batch = self._rows_batch(y)
            if batch is None:
                return y
            x = args[0].to(y.dtype).contiguous()  # the patch embedding takes raw pixel rows
            batch.op(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), lora_a, lora_b, batch.segments, ranks,
                     scales, slices)
            return y

        return add_lora
