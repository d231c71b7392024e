"""Merged / mixture modes over FP8 projections (serve/models/fp8.py): fold in by requantizing, fold out
by restoring the saved bytes.

An FP8 weight cannot take `W += dW` in place: the sum is formed in fp32 from the dequantized weight
and written back as FP8 with fresh per-channel scales (vlora_kernels.merge_fp8_: one Triton launch per
targeted slice on a GPU; vlora_kernels.merge_fp8_ref_ per layer in PyTorch on the CPU). Subtracting
dW again would round a second time and drift from the checkpoint's weights with every switch, so
the fold out copies back the bytes and scales saved by the fold in: unmerged FP8 weights are
bit-identical before and after any number of switches.

The saved copy is one buffer per projection kind, allocated at start beside the stacked weights
(as large as the FP8 weights: together they take what bf16 weights take), so a switch allocates
nothing and works while CUDA graphs hold the weights' addresses.
"""

from __future__ import annotations

import torch
from torch import nn

from vlora_kernels import FP8_DTYPE, merge_fp8_, merge_fp8_ref_


def is_fp8_projection(linear: nn.Module) -> bool:
    return linear.weight.dtype == FP8_DTYPE and hasattr(linear, "weight_scale")


class Fp8Stacks:
    """The FP8 weights ([L, N, K]) and scales ([L, N]) of each projection kind, with their saved copies."""

    def __init__(self, groups: dict[str, list[nn.Module]]):
        self.weights: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}
        for kind, linears in groups.items():
            self.weights[kind] = _restack(linears, "weight")
            self.scales[kind] = _restack(linears, "weight_scale")
        self.saved_weights = {k: torch.empty_like(w) for k, w in self.weights.items()}
        self.saved_scales = {k: torch.empty_like(s) for k, s in self.scales.items()}
        self.merged_slot: int | None = None  # the pool slot folded in (its saved copy is live)

    def fold_in(self, slot: int, pool, offsets: dict[str, list[int]], method: str = "one_shot") -> None:
        """method: "one_shot" (vlora_kernels.merge_fp8_, one Triton launch per targeted slice) or "addmm"
        (vlora_kernels.merge_fp8_ref_, per layer in PyTorch: the CPU path)."""
        fn = merge_fp8_ if method == "one_shot" else merge_fp8_ref_
        if self.merged_slot is not None:
            raise RuntimeError(f"FP8 weights hold pool slot {self.merged_slot}; fold it out before slot {slot}")
        for kind, weight in self.weights.items():
            self.saved_weights[kind].copy_(weight)
            self.saved_scales[kind].copy_(self.scales[kind])
            fn(weight, self.scales[kind], pool.lora_a[kind], pool.lora_b[kind], slot,
                           pool.merge_ranks(kind), pool.scales[kind], offsets[kind])
        self.merged_slot = slot

    def fold_out(self, slot: int) -> None:
        if self.merged_slot != slot:
            raise RuntimeError(f"FP8 weights hold pool slot {self.merged_slot}, not {slot}: nothing to fold out")
        for kind, weight in self.weights.items():
            weight.copy_(self.saved_weights[kind])
            self.scales[kind].copy_(self.saved_scales[kind])
        self.merged_slot = None

    def snapshot(self) -> dict:
        return {"weights": {k: w.clone() for k, w in self.weights.items()},
                "scales": {k: s.clone() for k, s in self.scales.items()}, "merged_slot": self.merged_slot}

    def restore(self, saved: dict) -> None:
        for k, w in saved["weights"].items():
            self.weights[k].copy_(w)
            self.scales[k].copy_(saved["scales"][k])
        self.merged_slot = saved["merged_slot"]

    def nbytes(self) -> dict[str, int]:
        """Bytes of the weights with their scales, and of the saved copies."""
        live = sum(w.nbytes + self.scales[k].nbytes for k, w in self.weights.items())
        return {"weights": live, "saved": live}


def _restack(linears: list[nn.Module], name: str) -> torch.Tensor:
    """One [L, ...] tensor of attribute `name` of every layer's projection; each becomes a view of its row."""
    first = getattr(linears[0], name)
    stacked = torch.empty((len(linears), *first.shape), dtype=first.dtype, device=first.device)
    for i, linear in enumerate(linears):
        stacked[i].copy_(getattr(linear, name).data)
        setattr(linear, name, nn.Parameter(stacked[i], requires_grad=False))
    return stacked
