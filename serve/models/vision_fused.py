"""Triton kernels of the Qwen vision towers' elementwise chains (GPU; the interpreter in CPU tests).

A camera chunk is about 3,000 patch rows through 32 blocks, so a chain that reads and writes the rows
a few times costs milliseconds per chunk. Profiled in a served step on an H200, the rotary embedding
of q and k that `torch.compile` generated (dynamic row count) took 3.7 ms of a chunk's 30.6 GPU ms, 17
times what its bytes cost; here it is one pass that reads q and k from the fused qkv projection and
writes the rotated pair.

    rotary_qk(qkv, cos, sin):  [rows, 3, heads, dim] -> [rows, 2, heads, dim], q and k rotated in fp32
                               (x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]), rounded
                               once to the input dtype, as `qwen_vision._rotary_qk` (the reference) does
    quick_gelu(x):             x * sigmoid(1.702 x) in fp32, rounded once (the reference rounds the
                               sigmoid and the products to bf16 one by one; the fused value is nearer fp32)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_qr, stride_qw, stride_qh,
                      stride_or, stride_ow, stride_oh, stride_c, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)  # 0: q, 1: k
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK)[None, :]
    mask = (h < heads) & (d < HALF)
    src = qkv_ptr + row * stride_qr + which * stride_qw + h * stride_qh + d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    col = cos_ptr + row * stride_c + d
    dmask = d < HALF
    c1 = tl.load(col, mask=dmask, other=0.0)
    c2 = tl.load(col + HALF, mask=dmask, other=0.0)
    s1 = tl.load(sin_ptr + row * stride_c + d, mask=dmask, other=0.0)
    s2 = tl.load(sin_ptr + row * stride_c + HALF + d, mask=dmask, other=0.0)
    dt = out_ptr.dtype.element_ty
    dst = out_ptr + row * stride_or + which * stride_ow + h * stride_oh + d
    tl.store(dst, (x1 * c1 + (-x2) * s1).to(dt), mask=mask)
    tl.store(dst + HALF, (x2 * c2 + x1 * s2).to(dt), mask=mask)


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """qkv: [rows, 3, heads, dim] (contiguous last dim); cos, sin: fp32 [rows, 1, 1, dim] or [rows, dim]
    -> [rows, 2, heads, dim] in qkv's dtype."""
    rows, three, heads, dim = qkv.shape
    cos, sin = cos.reshape(rows, -1), sin.reshape(rows, -1)
    if (three != 3 or qkv.stride(-1) != 1 or dim % 2 or cos.shape != (rows, dim) or sin.shape != cos.shape
            or cos.stride() != sin.stride() or cos.stride(-1) != 1 or cos.dtype != torch.float32
            or sin.dtype != torch.float32):
        raise ValueError(f"rotary_qk needs qkv [rows, 3, heads, dim] with a contiguous last dim and fp32 cos, sin "
                         f"[rows, dim]; got {tuple(qkv.shape)}, {tuple(cos.shape)} {cos.dtype}, {tuple(sin.shape)}")
    out = torch.empty((rows, 2, heads, dim), dtype=qkv.dtype, device=qkv.device)
    if rows:
        block_h, block = triton.next_power_of_2(heads), triton.next_power_of_2(dim // 2)
        _rotary_qk_kernel[(rows, 2)](qkv, cos, sin, out, heads, qkv.stride(0), qkv.stride(1), qkv.stride(2),
                                     out.stride(0), out.stride(1), out.stride(2), cos.stride(0), HALF=dim // 2,
                                     BLOCK_H=block_h, BLOCK=block, num_warps=4 if block_h * block >= 512 else 1)
    return out


@triton.jit
def _quick_gelu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x / (1.0 + tl.exp(-1.702 * x))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x) of a contiguous tensor, computed in fp32 and rounded once."""
    if not x.is_contiguous():
        raise ValueError(f"quick_gelu needs a contiguous tensor; got strides {x.stride()}")
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _quick_gelu_kernel[(triton.cdiv(n, 4096),)](x, out, n, BLOCK=4096, num_warps=8)
    return out
