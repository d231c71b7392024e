"""Per-step metadata shared by every layer of one forward pass (nano-vllm's `Context`).

The model runner fills one `StepContext` before a forward and clears it after; attention
layers read the paged-cache layout from it, and the LoRA layers (serve/lora) read the step's
adapter metadata from `lora` (a `LoraBatch`, built once per step and shared by all layers;
None when no token of the step uses an adapter).
Tensors live on the model's device; the `*_list` fields are the same numbers on the host for
the plain-PyTorch attention path, which loops over sequences.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StepContext:
    # tokens of the step, flattened: sequence i owns rows query_start[i]:query_start[i+1]
    slot_mapping: torch.Tensor  # int64 [T]: cache slot (block * block_size + offset) of each token's K/V
    query_start: torch.Tensor  # int32 [B + 1]: cumulative query lengths
    context_lens: torch.Tensor  # int32 [B]: K/V length of each sequence after this step
    block_tables: torch.Tensor  # int32 [B, max_blocks]: cache blocks of each sequence, padded with 0
    max_query_len: int
    max_context_len: int
    decode_only: bool  # every sequence has exactly one query token (the CUDA-graph case)
    query_lens_list: list[int] = field(default_factory=list)
    context_lens_list: list[int] = field(default_factory=list)
    adapters: list[str | None] = field(default_factory=list)  # adapter name per sequence (None = base)
    lora: Any = None  # serve.lora.LoraBatch of the step, or None (no token uses an adapter)


_CONTEXT: StepContext | None = None


def get_context() -> StepContext:
    if _CONTEXT is None:
        raise RuntimeError("no StepContext is set: attention layers run only inside the model runner's step")
    return _CONTEXT


def peek_context() -> StepContext | None:
    """The current context or None (layers that also run outside a step, e.g. LoRA projections)."""
    return _CONTEXT


def set_context(ctx: StepContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


@contextmanager
def step_context(ctx: StepContext):
    set_context(ctx)
    try:
        yield ctx
    finally:
        set_context(None)
