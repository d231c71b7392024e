"""Inference modes in the weights: merge / unmerge one adapter in place, and the mixture metadata.

Three modes (serve.orchestrator.Mode), two weight states:

| mode       | projection weights | tokens of adapter a | tokens of adapter x != a    | no adapter   |
| ---------- | ------------------ | ------------------- | --------------------------- | ------------ |
| unmerge    | W                  | + dW_a (ATMM)       | + dW_x (ATMM)               | nothing      |
| merge(a)   | W + dW_a           | nothing             | (not admitted)              | (not admitted)|
| mixture(a) | W + dW_a           | nothing             | + dW_x - dW_a (one pass)    | - dW_a       |

Mixture ("deLoRA") runs the step's LoRA operator once per projection, over the tokens not of `a`
only: each carries its own slot (slot -2 for a token of no adapter) and the batch's metadata
names `a` as the mixed-in slot, which every such token also applies with its scale negated, as
one problem of rank r_x + r_a (vlora_kernels/shrink.py, expand.py: the same A and B of a's pool slot,
no extra slot, no copy, no second launch). So y = x (W + dW_a)^T + x dW_x^T - x dW_a^T, the
unmerged output up to float rounding, and the LoRA work is that of the other adapters' tokens. The manager builds a `MixtureBatch` whenever the
weights hold an adapter, so a request of another adapter that is running across a switch
is always computed exactly; merge(a) differs from mixture(a) only in whom the scheduler admits.

Switches fold a pool slot into the base weights with `vlora_kernels.merge_lora_` (one Triton launch per
projection kind over all layers, on GPU) or `vlora_kernels.merge_lora_ref_` (per-layer fp32 addmm: the CPU
path, and dLoRA's "addmm" switch). Both need each kind's weights as one contiguous [L, N, K]
tensor: `WeightMerger` restacks them once at engine start and points every layer's `Linear.weight`
at its row (a view), so switches then run in place with no copy. FP8 projections
(quantization=fp8) fold in by requantizing and out by restoring saved bytes (fp8_merge.py).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from itertools import accumulate

import torch
from torch import nn

from vlora_kernels import MIX_ONLY, NO_LORA, SegmentMeta, build_segments, merge_lora_, merge_lora_ref_

from .fp8_merge import Fp8Stacks, is_fp8_projection
from .metadata import OPS, LoraBatch, LoraGraphBuffers

SWITCH_METHODS = ("auto", "one_shot", "addmm")


class MixtureBatch(LoraBatch):
    """A step's metadata while the weights hold adapter slot `merged_slot`: `slot_ids` gives every
    token not of the merged adapter its own slot (-2: no adapter of its own), the merged
    adapter's tokens -1 (no LoRA work); the segments carry `merged_slot` as the mixed-in slot."""

    def __init__(self, slot_ids: tuple[int, ...], merged_slot: int, device, op):
        super().__init__(slot_ids, device, op)
        self.merged_slot = merged_slot

    @functools.cached_property
    def segments(self) -> SegmentMeta:
        return build_segments(self.slot_ids, self.device, mix_slot=self.merged_slot)


def build_mixture_batch(slots: list[int], merged_slot: int, device: torch.device, backend: str) -> LoraBatch | None:
    """slots: the pool slot of every token (-1 = no adapter). None when no token needs LoRA work
    (every token is of the merged adapter: merge mode proper)."""
    own = tuple(NO_LORA if s == merged_slot else (MIX_ONLY if s == NO_LORA else s) for s in slots)
    if all(s == NO_LORA for s in own):
        return None
    return MixtureBatch(own, merged_slot, device, OPS[backend])


class MixtureGraphBuffers(LoraGraphBuffers):
    """Metadata buffers of a mixture step captured in a CUDA graph: the segments and the mixed-in
    slot, written before each replay, so one graph per bucket serves whichever adapter is merged.
    A mixture batch has at most as many segments as an unmerged one: the merged adapter's tokens
    form none, the tokens of no adapter (mixed-in part only) one."""

    def __init__(self, max_batch: int, num_slots: int, device: torch.device, backend: str):
        super().__init__(max_batch, num_slots, device, backend)
        self.mix_slot = torch.zeros(1, dtype=torch.int32, device=device)

    def static_batch(self, bs: int) -> MixtureBatch:
        meta = dataclasses.replace(super().static_batch(bs).segments, mix_slot=self.mix_slot, host_mix_slot=0)
        batch = MixtureBatch((), 0, self.token_order.device, self.op)
        batch.__dict__["segments"] = meta
        return batch

    def load(self, batch: MixtureBatch, bs: int) -> None:
        g = self.num_segments(bs)
        meta = build_segments(batch.slot_ids, "cpu", max_segments=g, max_tokens=bs, mix_slot=batch.merged_slot)
        self.write(meta, bs, g)
        self.mix_slot.copy_(meta.mix_slot, non_blocking=True)


class WeightMerger:
    """Owns the stacked projection weights ([L, N, K] per pool kind) and folds slots in and out."""

    def __init__(self, layers, pool, device: torch.device, method: str = "auto"):
        if method not in SWITCH_METHODS:
            raise ValueError(f"switch method {method!r} is not one of {SWITCH_METHODS}")
        self.pool, self.device = pool, device
        self.method = ("one_shot" if device.type == "cuda" else "addmm") if method == "auto" else method
        by_kind: dict[str, list] = {}
        for layer in layers:  # serve.lora.LoRALinear
            by_kind.setdefault(layer.kind, []).append(layer)
        self.weights: dict[str, torch.Tensor] = {}
        self.offsets: dict[str, list[int]] = {}
        for kind, group in by_kind.items():
            group.sort(key=lambda m: m.layer_index)
            if [m.layer_index for m in group] != list(range(pool.num_layers)):
                raise ValueError(f"projection kind {kind!r}: layers {[m.layer_index for m in group]} do not cover "
                                 f"0..{pool.num_layers - 1}; cannot stack them for merging")
            self.offsets[kind] = [0, *accumulate(group[0].base.output_slices)]
        # FP8 projections (serve/models/fp8.py) fold in by requantizing and out by restoring saved bytes
        fp8 = [is_fp8_projection(m.base) for group in by_kind.values() for m in group]
        self.fp8 = Fp8Stacks({k: [m.base for m in g] for k, g in by_kind.items()}) if fp8 and all(fp8) else None
        for kind, group in by_kind.items():
            self.weights[kind] = self.fp8.weights[kind] if self.fp8 else _restack([m.base for m in group])

    def fold(self, slot: int, sign: int, method: str | None = None) -> float:
        """W[kind] += sign * scale * B @ A of pool slot `slot`, every kind and layer, in place.
        Returns the wall time in ms (the device is synchronized around it: switches are rare)."""
        fn = merge_lora_ if (method or self.method) == "one_shot" else merge_lora_ref_
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *_: None)
        sync(self.device)
        start = time.perf_counter()
        if self.fp8 is not None and sign > 0:
            self.fp8.fold_in(slot, self.pool, self.offsets, method or self.method)
        elif self.fp8 is not None:
            self.fp8.fold_out(slot)
        else:
            for kind, weight in self.weights.items():
                fn(weight, self.pool.lora_a[kind], self.pool.lora_b[kind], slot, self.pool.merge_ranks(kind),
                   self.pool.scales[kind], self.offsets[kind], sign=sign)
        sync(self.device)
        return (time.perf_counter() - start) * 1e3

    def snapshot(self) -> dict:
        if self.fp8 is not None:
            return self.fp8.snapshot()
        return {k: w.clone() for k, w in self.weights.items()}

    def restore(self, saved: dict) -> None:
        if self.fp8 is not None:
            return self.fp8.restore(saved)
        for k, w in saved.items():
            self.weights[k].copy_(w)


def _restack(linears: list[nn.Module]) -> torch.Tensor:
    """One [L, N, K] tensor holding the weights of `linears` (serve.models Linear, one per layer);
    each layer's `weight` becomes a view of its row. Done once, layer by layer, at start."""
    first = linears[0].weight
    stacked = torch.empty((len(linears), *first.shape), dtype=first.dtype, device=first.device)
    for i, linear in enumerate(linears):
        stacked[i].copy_(linear.weight.data)
        linear.weight = nn.Parameter(stacked[i], requires_grad=False)  # the old tensor is freed here
    return stacked
