"""Fused elementwise kernels of the decoder (Triton, used with the "triton" backend on GPU).

A decode step of a 7B model is a few milliseconds of weight reads; every extra small kernel
per layer costs microseconds, so the eager chains of RMSNorm (eight kernels) and RoPE (about
ten) are one launch each here:

    rms_norm(x, w, eps, residual):  r = x + residual (rounded to x's dtype), y = w * norm(r)
    rope(x, cos, sin):              y = x * cos + rotate_half(x) * sin, per head
    rope_store(q, k, v, ...):       rope of q and k, k and v written to their K/V cache slots: one launch
                                    where rope(q), rope(k) and the cache's two index copies were four
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

from vlora_kernels.interpreter import chain_in, pdl_chained, pdl_launch
from vlora_kernels.row_ops import rms_norm_row, silu_mul


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     stride_x, stride_r, stride_o, stride_ro, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                     CHAIN: tl.constexpr):
    chain_in(CHAIN)
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
        chain = pdl_chained(x.device)
        _rms_norm_kernel[(x.shape[0],)](
            x, res, weight, out, res_out, x.shape[1], eps, x.stride(0), res.stride(0), out.stride(0),
            res_out.stride(0), HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(x.shape[1]), CHAIN=chain,
            num_warps=8 if x.shape[1] >= 2048 else 4, **pdl_launch(chain))
    return (out, res_out) if residual is not None else out


@triton.jit
def _rope_head(src, cos_row, sin_row, dst, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """One head of x * cos + rotate_half(x) * sin from src to dst (each pointing at the head's first element)."""
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    c1 = tl.load(cos_row + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_row + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    dt = dst.dtype.element_ty
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]; each product rounded like torch
    o1 = (f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)
    o2 = (f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)
    tl.store(dst + offs, o1.to(dt), mask=mask)
    tl.store(dst + HALF + offs, o2.to(dt), mask=mask)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
                 HALF: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    _rope_head(x_ptr + t * stride_xt + h * stride_xh, cos_ptr + t * stride_c, sin_ptr + t * stride_c,
               out_ptr + t * stride_ot + h * stride_oh, HALF, BLOCK)


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                       stride_cs, stride_ch, stride_c, N_HEADS: tl.constexpr, HALF: tl.constexpr,
                       BLOCK: tl.constexpr, CHAIN: tl.constexpr):
    # program (t, h): h < N_HEADS rotates query head h into q_out; else kv head j = h - N_HEADS: k rotated and v
    # as it is, both written to the token's cache slot (store_kv's index copies, without their two launches)
    chain_in(CHAIN)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cos_row, sin_row = cos_ptr + t * stride_c, sin_ptr + t * stride_c
    if h < N_HEADS:
        _rope_head(q_ptr + t * stride_qt + h * stride_qh, cos_row, sin_row, q_out_ptr + t * stride_ot + h * stride_oh,
                   HALF, BLOCK)
    else:
        j = h - N_HEADS
        slot = tl.load(slot_ptr + t)
        _rope_head(k_ptr + t * stride_kt + j * stride_kh, cos_row, sin_row,
                   k_cache_ptr + slot * stride_cs + j * stride_ch, HALF, BLOCK)
        offs = tl.arange(0, 2 * BLOCK)
        mask = offs < 2 * HALF
        v = tl.load(v_ptr + t * stride_vt + j * stride_vh + offs, mask=mask)
        tl.store(v_cache_ptr + slot * stride_cs + j * stride_ch + offs, v, mask=mask)


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


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """rope(q, cos, sin), with rope(k, cos, sin) and v written to their cache slots as serve/forward/attention.py's
    store_kv writes them, in one launch. q [T, H, D], k and v [T, KVH, D] (strided views of the qkv projection are
    fine); caches [blocks, block_size, KVH, D], contiguous; slot_mapping int64 [T]. Returns the rotated q."""
    t, n_heads, d = q.shape
    kv_heads = k.shape[1]
    fits = (k.shape == (t, kv_heads, d) and v.shape == k.shape and cos.shape == (t, d) and sin.shape == (t, d)
            and cos.stride() == sin.stride() and k_cache.shape == v_cache.shape and k_cache.dim() == 4
            and k_cache.shape[2:] == (kv_heads, d) and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.dtype == v_cache.dtype == q.dtype and slot_mapping.shape == (t,)
            and slot_mapping.dtype == torch.int64 and d % 2 == 0 and all(x.stride(-1) == 1 for x in (q, k, v, cos)))
    if not fits:
        raise ValueError(f"rope_store needs q [T, H, D], k and v [T, KVH, D] (last dims contiguous, D even), cos and "
                         f"sin [T, D], contiguous caches [blocks, block_size, KVH, D] of q's dtype and int64 slots "
                         f"[T]; got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, v {tuple(v.shape)}, cos "
                         f"{tuple(cos.shape)}, caches {tuple(k_cache.shape)} {k_cache.dtype} / "
                         f"{tuple(v_cache.shape)}, slots {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    out = torch.empty((t, n_heads, d), dtype=q.dtype, device=q.device)
    if t:
        chain = pdl_chained(q.device)
        _rope_store_kernel[(t, n_heads + kv_heads)](
            q, k, v, cos, sin, out, k_cache, v_cache, slot_mapping, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), k_cache.stride(1),
            k_cache.stride(2), cos.stride(0), N_HEADS=n_heads, HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2),
            CHAIN=chain, num_warps=1, **pdl_launch(chain))
    return out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr, CHAIN: tl.constexpr):
    chain_in(CHAIN)
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
        chain = pdl_chained(gate_up.device)
        _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block,
                                                     CHAIN=chain, num_warps=4, **pdl_launch(chain))
    return out
