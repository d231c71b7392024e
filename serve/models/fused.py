"""Fused elementwise kernels of the decoder (Triton, used with the "triton" backend on GPU).

A decode step of a 7B model is a few milliseconds of weight reads; every extra small kernel
per layer costs microseconds, so the eager chains of RMSNorm (eight kernels) and RoPE (about
ten) are one launch each here:

    rms_norm(x, w, eps, residual):  r = x + residual (rounded to x's dtype), y = w * norm(r)
    rope(x, cos, sin):              y = x * cos + rotate_half(x) * sin, per head
    silu_and_mul(gate_up):          y = silu(gate) * up (the MLP's [T, 2I] -> [T, I]: one read, one write)

They round their intermediates to the model dtype exactly where the transformers code does
(the normalised value before the weight multiply; each product of RoPE), so they compute what
the PyTorch path computes. The PyTorch path (`layers.RMSNorm`, `rope.RotaryEmbedding`) is the
reference and the CPU implementation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlora_kernels.row_ops import rms_norm_row, silu_mul


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     stride_x, stride_r, stride_o, stride_ro, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    y = rms_norm_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, row, n_cols, eps, stride_x, stride_r, stride_ro,
                     offs, mask, HAS_RES)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x: [T, D] -> y [T, D] (and the new residual x + residual when one is given)."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm needs x [T, D] with a contiguous last dim and weight [D]; got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if x.shape[0]:
        res = residual if residual is not None else x
        _rms_norm_kernel[(x.shape[0],)](
            x, res, weight, out, res_out, x.shape[1], eps, x.stride(0), res.stride(0), out.stride(0),
            res_out.stride(0), HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(x.shape[1]),
            num_warps=8 if x.shape[1] >= 2048 else 4)
    return (out, res_out) if residual is not None else out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
                 HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    base = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
    c1 = tl.load(cos_ptr + t * stride_c + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_c + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_c + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_c + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]; each product rounded like torch
    o1 = (f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)
    o2 = (f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)
    out = out_ptr + t * stride_ot + h * stride_oh
    tl.store(out + offs, o1.to(dt), mask=mask)
    tl.store(out + HALF + offs, o2.to(dt), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] (any strides with a contiguous last dim); cos, sin: [T, D] -> contiguous [T, H, D]."""
    t, n_heads, d = x.shape
    if x.stride(-1) != 1 or cos.shape != (t, d) or sin.shape != (t, d) or cos.stride() != sin.stride():
        raise ValueError(f"rope needs x [T, H, D] with a contiguous last dim and cos, sin [T, D]; got "
                         f"{tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    out = torch.empty((t, n_heads, d), dtype=x.dtype, device=x.device)
    if t:
        _rope_kernel[(t, n_heads)](x, cos, sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                                   cos.stride(0), HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2), num_warps=1)
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, silu_mul(gate, up, out_ptr), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2 * I] laid out [gate | up] (contiguous last dim) -> silu(gate) * up: [T, I]."""
    if gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_and_mul needs [T, 2 * I] with a contiguous last dim; got {tuple(gate_up.shape)}")
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block,
                                                     num_warps=4)
    return out
