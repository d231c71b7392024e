"""The row arithmetic the decoder's fused kernels share (serve/models/fused.py) with their FP8 variants
(vlora_kernels/fp8_fused.py), written once so that both round exactly where the transformers code does and
the FP8 kernels' activations stay those of the plain kernels, bit for bit."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, row, n_cols, eps, stride_x, stride_r, stride_ro,
                 offs, mask, HAS_RES: tl.constexpr):
    """One row of w * norm(x (+ residual)) in out_ptr's dtype (not stored); with HAS_RES, x + residual,
    rounded to the model dtype, is stored at res_out_ptr's row."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)  # the model-dtype add
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    h = (h * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)  # cast before the weight, as HF does
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    return (w.to(tl.float32) * h.to(tl.float32)).to(out_ptr.dtype.element_ty)


@triton.jit
def silu_mul(gate, up, out_ptr):
    """silu(gate) * up from float32 gate and up, in out_ptr's dtype; silu rounded to it first, as torch."""
    dt = out_ptr.dtype.element_ty
    return ((gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up).to(dt)
