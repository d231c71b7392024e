"""Facts about the Triton runtime the launchers need."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch), in Triton since 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


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


def pdl_available(device: torch.device) -> bool:
    """Whether kernels on `device` may use programmatic dependent launch (PDL).

    With PDL a kernel launched right behind another is scheduled while the first still runs,
    does the work that does not depend on it, then waits for it (`gdc_wait`). Hopper and
    newer only; never in the interpreter (which cannot run the wait). VLORA_PDL=0 turns it off.
    """
    if device.type != "cuda" or interpreted() or gdc_wait is None or os.environ.get("VLORA_PDL", "1") == "0":
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


def pdl_chained(device: torch.device) -> bool:
    """Whether the decoder's elementwise kernels (norms, RoPE with the cache writes, the SiLU-mul, the decode
    attention) are launched with PDL behind the kernel before them and let the one after them launch early.

    Each waits (`gdc_wait`) before its first load of anything another kernel writes, so it computes the same bits;
    what changes is that its launch and scheduling overlap the kernel before instead of following its end. A
    kernel launched with PDL behind one that never lets it (cuBLAS, torch's own) simply starts when that one
    ends, as without PDL.

    On by default on Hopper; VLORA_PDL_CHAIN=0 (read at import) turns it off. On an H200 at the 7B shape it takes
    0.05-0.07 ms off bf16's decode step with every logit unchanged, and FP8's logits match the unchained ones
    (results/fp8/nvidia_h200/pdl_chain/confirm/). The first runs gave FP8 without an adapter wrong logits: the
    split-K reduction read its activation scales before its wait, which is fixed.
    """
    return PDL_CHAIN and pdl_available(device)


def pdl_launch(on: bool) -> dict:
    """The launch keywords of a kernel scheduled with PDL behind the one before it (none when off)."""
    return {"launch_pdl": True} if on else {}


PDL_CHAIN = os.environ.get("VLORA_PDL_CHAIN", "1") != "0"  # read once, at import


@triton.jit
def chain_in(CHAIN: tl.constexpr):
    """A kernel's first step when launched with PDL (`pdl_chained`): the kernel after it may launch now; then wait
    until the kernel before it has ended and its writes are visible. It comes before any load of what another
    kernel writes and on every program's path, so that this kernel ends only after the one before it: a kernel
    launched behind this one and waiting for it then waits for everything before it too."""
    if CHAIN:
        gdc_launch_dependents()
        gdc_wait()


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


# quotient_rn's choice, fixed at import as the kernels' mode is (TRITON_INTERPRET is set before any kernel is defined)
FMA_DIVISION = tl.constexpr(not interpreted())


@triton.jit
def quotient_rn(x, d):
    """x / d rounded once to float32, as IEEE division (and torch's) rounds it, for finite d > 0 (on the GPU an infinite d,
    a row holding an infinity, gives NaN where division gives 0).

    On the GPU: one division for the reciprocal r = 1/d, then q = x * r and Markstein's correction
    q + (x - q * d) * r in two FMAs, which rounds to the IEEE quotient when r is correctly rounded and q is within
    an ulp (x - q * d is then exact in float32); x = -0 keeps its sign. A div.rn.f32 per element was half the time
    of the 7B's norm with its FP8 rows (4.6 us at batch 32; 2.35 with a multiply instead: H200). The
    interpreter's fma rounds twice (a multiply, then an add), so there it divides."""
    if FMA_DIVISION:
        r = tl.math.div_rn(1.0, d)
        q = x * r
        return tl.where(x == 0.0, q, tl.fma(tl.fma(-q, d, x), r, q))
    return tl.math.div_rn(x, d)
