"""Inference modes in the weights: merge / unmerge one adapter in place, and the mixture metadata.

Three modes (serve.orchestrator.Mode), two weight states:

| mode       | projection weights | tokens of adapter a | tokens of adapter x != a    | no adapter   |
| ---------- | ------------------ | ------------------- | --------------------------- | ------------ |
| unmerge    | W                  | + dW_a (ATMM)       | + dW_x (ATMM)               | nothing      |
| merge(a)   | W + dW_a           | nothing             | (not admitted)              | (not admitted)|
| mixture(a) | W + dW_a           | nothing             | + dW_x - dW_a (two passes)  | - dW_a       |

Mixture ("deLoRA") runs the step's LoRA operator twice per projection: the usual pass with each
token's own slot (tokens of `a` and of no adapter get slot -1), then a second pass where every
token not of `a` uses a's pool slot with the scales negated (`-scales`: the same A and B, no
extra pool slot, no copy). Both passes add into y, so y = x (W + dW_a)^T + x dW_x^T - x dW_a^T,
the unmerged output up to float rounding. The manager builds a `MixtureBatch` whenever the
weights hold an adapter, so a request of another adapter that is running across a switch
is always computed exactly; merge(a) differs from mixture(a) only in whom the scheduler admits.

Switches fold a pool slot into the base weights with `kernels.merge_lora_` (one Triton launch per
projection kind over all layers, on GPU) or `kernels.merge_lora_ref_` (per-layer fp32 addmm: the CPU
path, and dLoRA's "addmm" switch). Both need each kind's weights as one contiguous [L, N, K]
tensor: `WeightMerger` restacks them once at engine start and points every layer's `Linear.weight`
at its row (a view), so switches then run in place with no copy.
"""

from __future__ import annotations

import functools
import time
from itertools import accumulate

import torch
from torch import nn

from kernels import NO_LORA, SegmentMeta, build_segments, merge_lora_, merge_lora_ref_

from .metadata import OPS, LoraBatch, LoraGraphBuffers

SWITCH_METHODS = ("auto", "one_shot", "addmm")


class MixtureBatch(LoraBatch):
    """A step's metadata while the weights hold adapter slot `merged_slot`: `slot_ids` is the own
    pass (slot -1 for tokens of the merged adapter and of no adapter), `delora_slot_ids` the
    negative pass (the merged slot for every other token, -1 for the merged adapter's tokens)."""

    def __init__(self, slot_ids: tuple[int, ...], delora_slot_ids: tuple[int, ...], device, op):
        super().__init__(slot_ids, device, op)
        self.delora_slot_ids = delora_slot_ids
        self.has_own = any(s != NO_LORA for s in slot_ids)
        self.has_delora = any(s != NO_LORA for s in delora_slot_ids)

    @functools.cached_property
    def delora(self) -> SegmentMeta | None:
        return build_segments(self.delora_slot_ids, self.device) if self.has_delora else None


def build_mixture_batch(slots: list[int], merged_slot: int, device: torch.device, backend: str) -> LoraBatch | None:
    """slots: the pool slot of every token (-1 = no adapter). None when no token needs LoRA work
    (every token is of the merged adapter: merge mode proper)."""
    own = tuple(NO_LORA if s == merged_slot else s for s in slots)
    neg = tuple(NO_LORA if s == merged_slot else merged_slot for s in slots)
    batch = MixtureBatch(own, neg, device, OPS[backend])
    return batch if batch.has_own or batch.has_delora else None


class MixtureGraphBuffers:
    """Metadata buffers of a mixture step captured in a CUDA graph: the own pass and the negative
    pass each read one `LoraGraphBuffers`. Both passes are always in the graph; a pass with no
    tokens has only zero-length segments, which exit at once."""

    def __init__(self, max_batch: int, num_slots: int, device: torch.device, backend: str):
        self.own = LoraGraphBuffers(max_batch, num_slots, device, backend)
        self.neg = LoraGraphBuffers(max_batch, num_slots, device, backend)

    def static_batch(self, bs: int) -> MixtureBatch:
        own, neg = self.own.static_batch(bs), self.neg.static_batch(bs)
        batch = MixtureBatch((), (), own.device, own.op)
        batch.has_own = batch.has_delora = True
        batch.__dict__["segments"], batch.__dict__["delora"] = own.segments, neg.segments
        return batch

    def load(self, batch: MixtureBatch, bs: int) -> None:
        self.own.load(batch.slot_ids, bs)
        self.neg.load(batch.delora_slot_ids, bs)


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
            self.weights[kind] = _restack([m.base for m in group])
            self.offsets[kind] = [0, *accumulate(group[0].base.output_slices)]

    def fold(self, slot: int, sign: int, method: str | None = None) -> float:
        """W[kind] += sign * scale * B @ A of pool slot `slot`, every kind and layer, in place.
        Returns the wall time in ms (the device is synchronized around it: switches are rare)."""
        fn = merge_lora_ if (method or self.method) == "one_shot" else merge_lora_ref_
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda *_: None)
        sync(self.device)
        start = time.perf_counter()
        for kind, weight in self.weights.items():
            fn(weight, self.pool.lora_a[kind], self.pool.lora_b[kind], slot, self.pool.merge_ranks(kind),
               self.pool.scales[kind], self.offsets[kind], sign=sign)
        sync(self.device)
        return (time.perf_counter() - start) * 1e3

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: w.clone() for k, w in self.weights.items()}

    def restore(self, saved: dict[str, torch.Tensor]) -> None:
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
