"""LoRA-wrapped projections (vLLM's `*WithLoRA` tier): the base matmul once, then the batch's adapters.

    y = x @ W.T (+ b)                              # one matmul for every token of the step
    y[:, slice i] += scale[s] * x @ A[i, s].T @ B[s, slice i].T    for each token's slot s

The second line is one `op` call over all tokens (ATMM: two launches whatever the mix of
adapters, ranks and targets; tokens of slot -1 are untouched). A layer holds views of its
layer's rows of the pool, fixed at start, so swapping an adapter into a slot is visible to
every layer (and to captured CUDA graphs) without touching the layers.

While the weights hold a merged adapter a (mixture mode, serve/lora/modes.py), the step's batch is
a `MixtureBatch`: the same one call also adds -scale * x @ A[a].T @ B[a].T for every token not
of a (its segments name a as the mixed-in slot).
"""

from __future__ import annotations

import torch
from torch import nn

from vlora_kernels import add_lora, add_lora_beside
from serve.forward.context import peek_context

from .pool import AdapterPool


class LoRALinear(nn.Module):
    """A serve.models `Linear` with multi-adapter LoRA; x: [T, in] -> y: [T, sum(output_slices)]."""

    def __init__(self, base: nn.Module, pool: AdapterPool, kind: str, layer_index: int, overlap_shrink: bool = False):
        super().__init__()
        self.base = base
        self.kind, self.layer_index = kind, layer_index
        self.overlap_shrink = overlap_shrink  # with the ATMM op: the shrink beside the base matmul
        self.slices = tuple(base.output_slices)
        # plain attributes, not buffers: views into the pool, which owns (and never reallocates) them
        self.lora_a, self.lora_b, self.ranks, self.scales = pool.layer_views(kind, layer_index)

    # the base layer's description, so code reading projections sees the same shape either way
    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def output_slices(self) -> tuple[int, ...]:
        return self.base.output_slices

    @property
    def slice_names(self) -> tuple[str, ...]:
        return self.base.slice_names

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = peek_context()
        batch = None if ctx is None else ctx.lora
        if batch is None:
            return self.base(x)
        if self.overlap_shrink and batch.op is add_lora:
            return add_lora_beside(self.base, x, self.lora_a, self.lora_b, batch.segments, self.ranks, self.scales,
                                   self.slices)
        y = self.base(x)
        return batch.op(y, x, self.lora_a, self.lora_b, batch.segments, self.ranks, self.scales, self.slices)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, layer={self.layer_index}, rank={self.lora_a.shape[2]}"


def wrap_projections(language_model, pool: AdapterPool, overlap_shrink: bool = False) -> list[LoRALinear]:
    """Replaces every projection of a kind the pool holds by its LoRA-wrapped version."""
    wrapped = []
    for layer, kind, module in list(language_model.projections()):
        if kind not in pool.kinds or isinstance(module, LoRALinear):
            continue
        lora = LoRALinear(module, pool, kind, layer, overlap_shrink)
        language_model.set_projection(layer, kind, lora)
        wrapped.append(lora)
    return wrapped
