"""Facts about the Triton runtime the launchers need."""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreted() -> bool:
    """True when kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1).

    The interpreter (seen in Triton 3.8) multiplies bfloat16 `tl.dot` operands wrongly, so the
    kernels upcast their dot operands to float32 there: the products of bf16/fp16 values are
    exact in float32, so this computes what the GPU's fp32-accumulating dot computes.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def dot_nt(acc, a, b, UPCAST_DOT: tl.constexpr):
    """acc + a @ b.T with fp32 accumulation; a: [M, K], b: [N, K] (both K-contiguous tiles).

    UPCAST_DOT: pass `interpreted()`; the operands are then multiplied as float32 (see above).
    """
    if UPCAST_DOT:
        return acc + tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
    return acc + tl.dot(a, tl.trans(b))
