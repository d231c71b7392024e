"""Layer objects of the serving language model: the projection hook points, norm, embedding.

Every projection of a decoder layer is a `Linear` module held as an attribute
(`layer.attn.qkv_proj`, `layer.attn.o_proj`, `layer.mlp.gate_up_proj`, `layer.mlp.down_proj`),
so the adapter side can wrap or replace it (`DecoderModel.set_projection`) without touching
the model code. Fused projections keep their logical parts as contiguous column slices of the
output, in the order of `slice_names`:

    qkv_proj:     y = [ q (num_heads * head_dim) | k (num_kv_heads * head_dim) | v (same) ]
    gate_up_proj: y = [ gate (intermediate) | up (intermediate) ]
    o_proj, down_proj: one slice each

`output_slices` is exactly the `slices` argument of `vlora_kernels.add_lora`, and the weight rows
follow the same order (the checkpoint's q_proj/k_proj/v_proj rows stacked), so a PEFT
adapter's per-module lora_B goes to the matching slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); x: [T, in_features] -> y: [T, sum(output_slices)]."""

    def __init__(self, in_features: int, output_slices: tuple[int, ...], slice_names: tuple[str, ...],
                 bias: bool = False, dtype: torch.dtype | None = None, device=None, layer_index: int = -1):
        super().__init__()
        if len(output_slices) != len(slice_names):
            raise ValueError(f"output_slices {output_slices} and slice_names {slice_names} differ in length")
        self.in_features = in_features
        self.output_slices = tuple(int(s) for s in output_slices)
        self.slice_names = tuple(slice_names)
        self.layer_index = layer_index
        out = sum(self.output_slices)
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    @property
    def out_features(self) -> int:
        return sum(self.output_slices)

    def slice_range(self, name: str) -> tuple[int, int]:
        """[start, end) output columns of the logical projection `name` (e.g. "k_proj")."""
        if name not in self.slice_names:
            raise KeyError(f"{name!r} is not a slice of this projection; slices: {self.slice_names}")
        i = self.slice_names.index(name)
        start = sum(self.output_slices[:i])
        return start, start + self.output_slices[i]

    def load_slice(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        start, end = self.slice_range(name)
        if tuple(weight.shape) != (end - start, self.in_features):
            raise ValueError(f"{name}: checkpoint weight {tuple(weight.shape)} does not fit "
                             f"[{end - start}, {self.in_features}]")
        self.weight.data[start:end].copy_(weight)
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"{name}: the checkpoint has a bias but the layer was built without one")
            self.bias.data[start:end].copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, slices={dict(zip(self.slice_names, self.output_slices))}"


class RMSNorm(nn.Module):
    """Llama/Qwen2 RMSNorm, computed in float32 and cast back as Hugging Face does.

    forward(x) -> y; forward(x, residual) -> (y, x + residual): the residual add fused in front,
    one Triton kernel when `fused` (GPU), the same arithmetic in PyTorch otherwise.
    """

    def __init__(self, dim: int, eps: float, dtype=None, device=None, fused: bool = False):
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.fp8_output = False  # FP8 projection next: the fused kernel also writes y's FP8 rows (serve/models/fp8.py)
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused and self.fp8_output:
            from vlora_kernels.fp8 import rows_wanted
            from vlora_kernels.fp8_fused import rms_norm_fp8

            if rows_wanted(x):  # at decode sizes the FP8 GEMM may take the bf16 output as it is
                return rms_norm_fp8(x, self.weight, self.eps, residual)
        if self.fused:
            from .fused import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * I] laid out [gate | up] -> silu(gate) * up: [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
