"""Per-token FP8 quantization fused into the kernel that produces the activation (vlora_kernels/fp8.py's
`quantize_rows` without its own launch).

At decode an FP8 projection's activation is a few rows, and quantizing it alone is one more tiny,
latency-bound launch per projection (4 a layer: qkv, o, gate_up, down). Two producers already hold
a whole row when they write it, so they can write its FP8 copy too:

    rms_norm_fp8(x, w, eps, residual):  the decoder's fused RMSNorm (serve/models/fused.py), whose
        program has the normed row in registers: its amax, the scale and the cast cost no extra read.
        Feeds qkv_proj (input_layernorm) and gate_up_proj (post_attention_layernorm).
    silu_mul_fp8(gate_up):              silu(gate) * up by blocks of a row, each with its amax; then
        a second launch, also by blocks, takes the row's scale from those amaxes and casts what the
        first wrote. Two launches that fill the GPU at decode, not one program per long row.
        Feeds down_proj.

Both return the model-dtype activation exactly as the unfused kernels do (the LoRA branch and
anything else read it) and attach its FP8 rows with `vlora_kernels.fp8.attach_rows`, which `fp8_linear`
uses instead of quantizing again. The FP8 bytes and scales equal `quantize_rows` of that
activation, byte for byte: the fusion changes launches, not results. o_proj's input (the
attention output) is written per (sequence, head) and has no program holding a row; it is still
quantized on its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import FP8_DTYPE, FP8_MAX, SCALE_FLOOR, attach_rows, quantize_row, quantize_rows_ref
from .interpreter import (chain_in, gdc_launch_dependents, gdc_wait, interpreted, pdl_available, pdl_chained,
                          pdl_launch, quotient_rn)
from .row_ops import rms_norm_row, silu_mul


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, s_ptr, n_cols, eps,
                         stride_x, stride_r, stride_o, stride_ro, stride_q, HAS_RES: tl.constexpr,
                         FP8_LIMIT: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr,
                         LAUNCH_DEPENDENTS: tl.constexpr, WAIT: tl.constexpr):
    # serve/models/fused.py's _rms_norm_kernel (the same row_ops.rms_norm_row), then the row's quantization
    if LAUNCH_DEPENDENTS:  # the FP8 GEMM behind may launch now and prefetch its weight (vlora_kernels/fp8_decode.py)
        gdc_launch_dependents()
    if WAIT:  # launched with PDL behind x's producer (interpreter.pdl_chained): x and residual written past here
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    y = rms_norm_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, row, n_cols, eps, stride_x, stride_r, stride_ro,
                     offs, mask, HAS_RES)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)
    quantize_row(y.to(tl.float32), q_ptr + row * stride_q, s_ptr + row, offs, mask, FP8_LIMIT, FLOOR)


@triton.jit
def _silu_mul_fp8_kernel(x_ptr, out_ptr, amax_ptr, n_cols, stride_x, stride_o, n_blocks, BLOCK: tl.constexpr,
                         CHAIN: tl.constexpr):
    # program (row, block): silu(gate) * up of one block of the row (serve/models/fused.py's arithmetic),
    # written, and the block's amax. A row is 18944 wide on the 7B and a decode step has few rows: one
    # program per row left the GPU nearly idle (14 us a call at batch 1, H200) where blocks fill it.
    chain_in(CHAIN)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    act = silu_mul(gate, up, out_ptr)
    tl.store(out_ptr + row * stride_o + offs, act, mask=mask)
    tl.store(amax_ptr + row * n_blocks + blk, tl.max(tl.abs(act.to(tl.float32)), axis=0))


@triton.jit
def _cast_blocks_fp8_kernel(act_ptr, amax_ptr, q_ptr, s_ptr, n_cols, stride_a, stride_q, n_blocks,
                            FP8_LIMIT: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr,
                            BLOCKS_P2: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, WAIT: tl.constexpr):
    # program (row, block): the row's scale from its blocks' amaxes (max is exact in any order: the
    # same scale as one sweep), then the block's FP8 copy of the activation as written
    if LAUNCH_DEPENDENTS:  # the FP8 GEMM behind may launch now and prefetch its weight (vlora_kernels/fp8_decode.py)
        gdc_launch_dependents()
    if WAIT:  # launched with PDL behind _silu_mul_fp8_kernel: its activation and amaxes written past here
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    b = tl.arange(0, BLOCKS_P2)
    amax = tl.max(tl.load(amax_ptr + row * n_blocks + b, mask=b < n_blocks, other=0.0), axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_LIMIT), FLOOR)
    if blk == 0:
        tl.store(s_ptr + row, scale)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    act = tl.load(act_ptr + row * stride_a + offs, mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(quotient_rn(act, scale), -FP8_LIMIT), FP8_LIMIT)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def _fp8_buffers(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    # the interpreter rounds float32 -> e4m3 wrongly (vlora_kernels/fp8.py): there the kernel writes the
    # clamped float32 values and torch casts them with round-to-nearest-even, as the GPU's cvt.rn does
    q = torch.empty((rows, cols), dtype=torch.float32 if interpreted() else FP8_DTYPE, device=device)
    return q, torch.empty((rows, 1), dtype=torch.float32, device=device)


def _check_rows(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name} needs [T, D] with a contiguous last dim; got shape {tuple(x.shape)} strides "
                         f"{x.stride()}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name}: dtype must be float16, bfloat16 or float32, got {x.dtype}")


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """serve.models.fused.rms_norm (y, or (y, x + residual)), with y carrying its FP8 rows (attach_rows)."""
    _check_rows("rms_norm_fp8", x)
    if weight.shape != (x.shape[1],) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"rms_norm_fp8: weight {tuple(weight.shape)} and residual "
                         f"{None if residual is None else tuple(residual.shape)} do not fit x {tuple(x.shape)}")
    t, d = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    q, scale = _fp8_buffers(t, d, x.device)
    if t:
        res = residual if residual is not None else x
        chain = pdl_chained(x.device)
        _rms_norm_fp8_kernel[(t,)](x, res, weight, out, res_out, q, scale, d, eps, x.stride(0), res.stride(0),
                                   out.stride(0), res_out.stride(0), q.stride(0), HAS_RES=residual is not None,
                                   FP8_LIMIT=FP8_MAX, FLOOR=SCALE_FLOOR, BLOCK=triton.next_power_of_2(d),
                                   LAUNCH_DEPENDENTS=pdl_available(x.device), WAIT=chain,
                                   num_warps=8 if d >= 2048 else 4, **pdl_launch(chain))
    attach_rows(out, q.to(FP8_DTYPE) if q.dtype != FP8_DTYPE else q, scale)
    return (out, res_out) if residual is not None else out


def silu_mul_fp8(gate_up: torch.Tensor) -> torch.Tensor:
    """serve.models.fused.silu_and_mul ([T, 2I] [gate | up] -> [T, I]), carrying its FP8 rows."""
    _check_rows("silu_mul_fp8", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul_fp8 needs [T, 2 * I]; got {tuple(gate_up.shape)}")
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    q, scale = _fp8_buffers(t, n, gate_up.device)
    if t:
        block = min(1024, max(16, triton.next_power_of_2(n)))
        blocks = triton.cdiv(n, block)
        amax = torch.empty((t, blocks), dtype=torch.float32, device=gate_up.device)
        chain = pdl_chained(gate_up.device)
        _silu_mul_fp8_kernel[(t, blocks)](gate_up, out, amax, n, gate_up.stride(0), out.stride(0), blocks,
                                           BLOCK=block, CHAIN=chain, num_warps=4, **pdl_launch(chain))
        _cast_blocks_fp8_kernel[(t, blocks)](out, amax, q, scale, n, out.stride(0), q.stride(0), blocks,
                                             FP8_LIMIT=FP8_MAX, FLOOR=SCALE_FLOOR, BLOCK=block,
                                             BLOCKS_P2=max(2, triton.next_power_of_2(blocks)),
                                             LAUNCH_DEPENDENTS=pdl_available(gate_up.device), WAIT=chain,
                                             num_warps=4, **pdl_launch(chain))
    attach_rows(out, q.to(FP8_DTYPE) if q.dtype != FP8_DTYPE else q, scale)
    return out


def rms_norm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The same in PyTorch (serve/models/layers.RMSNorm's arithmetic, then quantize_rows_ref): the oracle.
    Returns (y, new residual or None, q, scale)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    y = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    q, scale = quantize_rows_ref(y)
    return y, (x if residual is not None else None), q, scale


def silu_mul_fp8_ref(gate_up: torch.Tensor):
    """silu(gate) * up in PyTorch, and its quantize_rows_ref: (act, q, scale)."""
    gate, up = gate_up.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    q, scale = quantize_rows_ref(act)
    return act, q, scale
