"""The FP8 projection GEMM at decode sizes (at most MAX_M = 64 tokens), in Triton:

    y[M, N] (bf16) = (q_x[M, K] @ q_w[N, K].T) * s_x[M, 1] * s_w[N]      (vlora_kernels/fp8.py's fp8_linear math)

Why: cuBLAS's rowwise-scaled FP8 kernel tiles the tokens by 128, so at 1-64 tokens it streams the FP8
weight at 0.6-2.5 TB/s, under bf16's 2.2-3.7 (H200, results/fp8/nvidia_h200/third_run/). Here the
weight is the wide side: a program takes BLOCK_N output channels by a range of K, reads that weight
tile once, and multiplies it by all the tokens, padded to BLOCK_M (16, 32 or 64) by load masks, not
copies: `tl.dot(w_tile [BLOCK_N, BLOCK_K], x_tile.T [BLOCK_K, BLOCK_M])`, so on sm_90 the FP8 wgmma
takes the channels as its M (64 a warpgroup) and the few tokens as its N (16-64). Both operands are
K-contiguous in memory, as FP8 wgmma requires.

Split-K: the small-N projections (N 3584-4608: 28-72 channel tiles) would leave most of 132 SMs idle,
so K is split over SPLIT_K programs. Each writes its fp32 partial sum to a [SPLIT_K, M, N] buffer and
a second launch sums the splits, applies both scales and writes bf16. That is two launches, with no
zeroing (every partial is written) and a fixed summation order, so results repeat bit for bit run to
run; atomics into an fp32 buffer would need a zeroing launch too (three) and sum in any order. The
partials (SPLIT_K * M * N * 4 bytes, at most 7 MB) stay in L2. On Hopper the reduction is launched
with programmatic dependent launch (vlora_kernels/interpreter.py `pdl_available`; VLORA_PDL=0 turns it off),
so its launch overlaps the GEMM and it waits for the partials on the device. Without split-K the scales and the
bf16 cast are the GEMM's epilogue: one launch. Summing in the GEMM's own launch instead (the last split of each
channel tile to finish, found by a counter per tile, reads the others' partials back) was measured slower on an
H200: the 7B decode step at batch 32 took 3.91 ms against 3.86, since its serial tail lengthened every split GEMM
while the PDL launch is already resident (results/fp8/nvidia_h200/split_sums/).

Accumulation: every FP8 wgmma's sum of 32 products is added into an fp32 accumulator
(max_num_imprecise_acc=32), as cuBLAS's non-fast accumulation promotes; Triton's sm_90 default would keep
the whole K in the tensor cores' narrower accumulator, and 0 (no imprecise sums at all) makes Triton
drop wgmma for an fp16 mma.sync of upcast operands (seen in Triton 3.8's PTX).

The weight-only form (`fp8w_decode_mm`, X_FP8 off): x stays bf16 (or fp16), each FP8 weight tile is widened
to x's type in registers (two e4m3 values a conversion, exact) and the dot is a 16-bit wgmma with the weight
as its register operand; only s_w scales the sum. No activation is quantized: no quantization launch, no fused
producer's FP8 pass, no 3-bit mantissa on the activation. Measured on an H200 it streams the weight at half
the FP8 form's rate (the widening, e4m3 -> f16 -> bf16, sits between the shared-memory tile and the wgmma),
so vlora_kernels/fp8.py DECODE_ACTIVATIONS keeps the FP8 form by default.

PDL behind the producer (GEMM_PDL, on where `pdl_available`): the GEMM is launched while the kernel that writes
x (the fused norm, the SiLU-mul's cast, quantize_rows: each releases it as it starts) still runs; each program asks
L2 for its first PREFETCH_TILES weight tiles, then waits for x (gdc_wait) before any load or store. On an H200 the 7B
decode step went from 3.84 to 3.74-3.79 ms at batch 32 and from 3.51 to 3.36 at batch 1, with the same bits
(results/fp8/nvidia_h200/gemm_pdl/).

Scale groups and bias: s_x may hold one scale per (token, group of consecutive K tiles) instead of one per token, as
the decode attention writes o_proj's input (one group per kv head: serve/forward/decode_kernel.py); each group's sum is
scaled as it ends, and a split is widened to whole groups. A bias is added in fp32 in the epilogue (or the split-K
reduction) before the one rounding, which saves qkv_proj's separate add.

`fp8_linear` (vlora_kernels/fp8.py) runs this kernel at 1..DECODE_KERNEL_MAX_M tokens (64) on Hopper, where it
was tuned and measured faster than `_scaled_mm`; the environment variable VLORA_FP8_DECODE_MAX_M (an
integer 0..64, read once at import) overrides the count, on any GPU (0 turns the kernel off). Nothing here syncs
with the host; buffers are allocated by shape only, so the forward stays capturable in a CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .interpreter import gdc_launch_dependents, gdc_wait, interpreted, pdl_available, pdl_chained, pdl_launch

WGMMA_K = tl.constexpr(32)  # K of one FP8 wgmma instruction: its sum is promoted to fp32 after each
MAX_M = 64  # tokens: BLOCK_M is the next power of two >= M, at least 16 (wgmma's N), at most 64
# with the PDL chain (interpreter.pdl_chained), whether a GEMM without split-K lets the kernel after it launch as it
# starts (gate_up's SiLU-mul); the split GEMMs always release their reduction. Without it the FP8 step at batch 32
# was 0.09-0.10 ms longer on an H200 (results/fp8/nvidia_h200/pdl_chain/, runs whose FP8 logits were still wrong
# for another reason, since fixed; the release itself changes no value)
UNSPLIT_RELEASE = True

# Launch configurations, (n, k) -> (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), for Qwen2-VL-7B's
# projections. gate_up and down: the sweep's best summed over 1, 32 and 64 tokens on an H200
# (`python -m bench.fp8_decode_sweep`, results/fp8/nvidia_h200/fourth_run/sweep.csv); qkv and o: first guesses,
# which their sweep found best or within 0.4 us of it (results/fp8/nvidia_h200/fifth_run/sweep_qkv_o.csv). Goal: >= 2 programs per SM of an H100/H200 (132), each streaming >= 7 weight tiles of
# BLOCK_N x 128 bytes, 4 stages in flight. Other shapes: _fallback.
CONFIGS = {
    (4608, 3584): (64, 128, 4, 4, 4),    # qkv_proj: 72 channel tiles x 4 splits of 7 K tiles = 288 programs
    (3584, 3584): (64, 128, 4, 4, 4),    # o_proj: 56 x 4 = 224
    (37888, 3584): (128, 128, 1, 4, 3),  # gate_up_proj: 296 channel tiles, no split: one launch (4 stages: 1.2-1.4x slower at 32-64 tokens)
    (3584, 18944): (64, 128, 4, 4, 5),   # down_proj: 56 x 4 splits of 37 K tiles = 224
}
# the weight-only form's own launches where a sweep (--activations bf16) found better ones; others: CONFIGS
# (results/fp8/nvidia_h200/weight_only/sweep_w.csv: gate_up 1.24-1.37x faster than with CONFIGS' launch)
W_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int, int]] = {
    (37888, 3584): (64, 128, 1, 4, 3),  # gate_up_proj
    (3584, 18944): (64, 128, 4, 4, 3),  # down_proj
}
TARGET_PROGRAMS = 264  # _fallback: two programs per SM on a 132-SM card
# tiles of its weight a PDL-launched program asks L2 for before it waits for x (GEMM_PDL): 4 tiles of 64-128 rows
# by 128 bytes over 224-296 programs are 7-19 MB, about what HBM delivers while a short producer ends, and well
# within L2 (50-60 MB)
PREFETCH_TILES = 4
MIN_K_TILES_PER_SPLIT = 4  # a split shorter than this spends more on its partial than it saves
# channel tiles a launch may take. Below 64 (a wgmma's M) Triton compiles the dot to mma.sync on f16 operands, each
# e4m3 tile widened in registers (exact): more programs over the same weight, so fewer or no K splits to sum. On an
# H200 they were 4-22% slower than CONFIGS' for the 7B's projections (results/fp8/nvidia_h200/narrow_tiles/); kept
# for the sweep (--block-n) on other shapes and GPUs
BLOCK_NS = (16, 32, 64, 128, 256)
MAX_SPLIT_K = 16


def decode_max_m(default: int, environ=None) -> int:
    """fp8_linear's DECODE_KERNEL_MAX_M: `default`, or VLORA_FP8_DECODE_MAX_M when set (0..MAX_M)."""
    raw = (os.environ if environ is None else environ).get("VLORA_FP8_DECODE_MAX_M", "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) > MAX_M:
        raise ValueError(f"VLORA_FP8_DECODE_MAX_M must be an integer from 0 to {MAX_M} (tokens), got {raw!r}")
    return int(raw)


DECODE_ACTIVATION_KINDS = ("bf16", "fp8")


def decode_activations(default: str, environ=None) -> str:
    """fp8_linear's DECODE_ACTIVATIONS: `default`, or VLORA_FP8_DECODE_ACTIVATIONS when set (bf16 | fp8)."""
    raw = (os.environ if environ is None else environ).get("VLORA_FP8_DECODE_ACTIVATIONS", "").strip()
    if not raw:
        return default
    if raw not in DECODE_ACTIVATION_KINDS:
        raise ValueError(f"VLORA_FP8_DECODE_ACTIVATIONS must be one of {DECODE_ACTIVATION_KINDS}, got {raw!r}")
    return raw


def gemm_pdl(environ=None) -> bool:
    """GEMM_PDL: VLORA_FP8_GEMM_PDL (1, the default, or 0)."""
    raw = (os.environ if environ is None else environ).get("VLORA_FP8_GEMM_PDL", "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"VLORA_FP8_GEMM_PDL must be 0 or 1, got {raw!r}")
    return raw == "1"


# Whether the GEMM is launched with programmatic dependent launch where PDL is available (Hopper;
# vlora_kernels/interpreter.py pdl_available, which VLORA_PDL=0 turns off everywhere): each program asks L2 for its
# first weight tiles, then waits for x's producer to finish (gdc_wait). The producers (vlora_kernels/fp8.py's
# quantize_rows, vlora_kernels/fp8_fused.py's norm and SiLU-mul) let it launch as they start. Read once at import; the
# bench's A/B (bench.fp8.compare_gemm_pdl) turns it off for one engine.
GEMM_PDL = gemm_pdl()


def decode_kernel_on(capability: tuple[int, int], environ=None) -> bool:
    """Whether fp8_linear runs this kernel on a GPU of `capability`: on Hopper (9.x), where its launch table
    was tuned and timed; elsewhere only when VLORA_FP8_DECODE_MAX_M is set (an FP8 GPU of another
    generation keeps `_scaled_mm` until the kernel is measured there)."""
    raw = (os.environ if environ is None else environ).get("VLORA_FP8_DECODE_MAX_M", "").strip()
    return capability[0] == 9 or bool(raw)


def _fallback(n: int, k: int) -> tuple[int, int, int, int, int]:
    block_n, block_k = (128 if triton.cdiv(n, 128) >= TARGET_PROGRAMS else 64), 128
    tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split = max(1, min(triton.cdiv(TARGET_PROGRAMS, tiles), k_tiles // MIN_K_TILES_PER_SPLIT, MAX_SPLIT_K))
    return block_n, block_k, split, 4, 4


def decode_config(n: int, k: int, split_k: int | None = None, weight_only: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for an [N, K] weight; split_k overrides SPLIT_K
    (clamped to the number of K tiles, so that no split is empty); weight_only: fp8w_decode_mm's launch."""
    block_n, block_k, split, warps, stages = ((weight_only and W_CONFIGS.get((n, k))) or CONFIGS.get((n, k))
                                              or _fallback(n, k))
    if split_k is not None:
        split = split_k
    return block_n, block_k, max(1, min(split, triton.cdiv(k, block_k))), warps, stages


# both kernels' names hold "gemm", so bench/fp8_profile.py counts their time as the projections' GEMMs
@triton.jit
def _fp8_decode_gemm_kernel(x_ptr, w_ptr, sx_ptr, sw_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sx,
                       stride_os, stride_om, K_TILES_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, UPCAST_DOT: tl.constexpr,
                       LAUNCH_DEPENDENTS: tl.constexpr, X_FP8: tl.constexpr, WAIT_FOR_INPUTS: tl.constexpr,
                       PREFETCH_LINES: tl.constexpr, GROUP_TILES: tl.constexpr, HAS_BIAS: tl.constexpr):
    # X_FP8: x holds e4m3 tokens with their scales (FP8 wgmma); else x is the bf16/fp16 activation itself
    # and each weight tile is widened to x's type in registers (a 16-bit wgmma; no s_x)
    # GROUP_TILES > 0: x's scales are per (token, group of GROUP_TILES K tiles), s_x [M, K / (GROUP_TILES *
    # BLOCK_K)]; each group's sum is scaled as it ends (a split holds whole groups). 0: one scale per token.
    # grid: (N tiles, SPLIT_K). acc is y.T's tile: channels down, tokens across.
    if LAUNCH_DEPENDENTS:  # the reduction behind may be scheduled now; it waits for the partials itself
        gdc_launch_dependents()
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n, mask_m = offs_n < N, offs_m < M
    k_lo = pid_k * K_TILES_PER_SPLIT * BLOCK_K
    if WAIT_FOR_INPUTS:  # launched with PDL behind x's producer, which may still be running
        _prefetch_weight_l2(w_ptr, offs_n, N, K, k_lo, stride_wn, PREFETCH_LINES)
        gdc_wait()  # x written and visible past here; nothing is stored before it
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if GROUP_TILES == 0:
        acc = _dot_tiles(acc, w_ptrs, x_ptrs, k_lo + offs_k, K, mask_n, mask_m, K_TILES_PER_SPLIT, BLOCK_K,
                         UPCAST_DOT, X_FP8)
    else:
        for g in tl.static_range(K_TILES_PER_SPLIT // GROUP_TILES):
            part = _dot_tiles(tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), w_ptrs + g * GROUP_TILES * BLOCK_K,
                              x_ptrs + g * GROUP_TILES * BLOCK_K, k_lo + g * GROUP_TILES * BLOCK_K + offs_k, K,
                              mask_n, mask_m, GROUP_TILES, BLOCK_K, UPCAST_DOT, X_FP8)
            group = pid_k * (K_TILES_PER_SPLIT // GROUP_TILES) + g
            s_g = tl.load(sx_ptr + offs_m * stride_sx + group, mask=mask_m & (group * GROUP_TILES * BLOCK_K < K),
                          other=0.0)  # a last split past K: no group, its (zero) sum scaled by 0
            acc += part * s_g[None, :]
    out_mask = mask_n[:, None] & mask_m[None, :]
    out_offs = offs_m[None, :] * stride_om + offs_n[:, None]
    if SPLIT:  # fp32 partial of split pid_k; _fp8_decode_gemm_reduce_kernel scales and casts
        tl.store(out_ptr + pid_k * stride_os + out_offs, acc, mask=out_mask)
    else:
        s_w = tl.load(sw_ptr + offs_n, mask=mask_n, other=0.0)
        y = acc * s_w[:, None]
        if X_FP8 and GROUP_TILES == 0:
            y = y * tl.load(sx_ptr + offs_m * stride_sx, mask=mask_m, other=0.0)[None, :]
        if HAS_BIAS:  # added in fp32 before the one rounding to the output's type
            y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _dot_tiles(acc, w_ptrs, x_ptrs, cols, K, mask_n, mask_m, TILES: tl.constexpr, BLOCK_K: tl.constexpr,
               UPCAST_DOT: tl.constexpr, X_FP8: tl.constexpr):
    """acc + the products of TILES consecutive K tiles from w_ptrs / x_ptrs; cols: the first tile's K columns."""
    for t in range(0, TILES):
        k_in = cols + t * BLOCK_K < K  # K's tail, and the last split's tiles past K
        w = tl.load(w_ptrs, mask=mask_n[:, None] & k_in[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=mask_m[:, None] & k_in[None, :], other=0.0)  # tokens past M: zero rows
        if UPCAST_DOT:  # the interpreter: products of e4m3 (and of e4m3 by bf16) values are exact in fp32
            acc = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
        elif X_FP8:
            acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=WGMMA_K)
        else:  # every e4m3 value is exact in bf16 and fp16
            acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _prefetch_weight_l2(w_ptr, offs_n, N, K, k_lo, stride_wn, LINES: tl.constexpr):
    """Asks L2 for the first LINES 128-byte lines of each of this program's weight rows from k_lo (its first
    tiles): the weight does not depend on the kernel before, so its reads start while that kernel ends.
    Rows past N and lines past K are clamped onto the last (a repeated prefetch costs nothing)."""
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    cols = tl.minimum(k_lo + tl.arange(0, LINES) * 128, K - 1)
    lines = w_ptr + rows[:, None] * stride_wn + cols[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _fp8_decode_gemm_reduce_kernel(part_ptr, sx_ptr, sw_ptr, bias_ptr, y_ptr, N, stride_ps, stride_sx, stride_ym,
                                   SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                                   X_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr):
    # grid: (M, N blocks): y[m, n] = sum over splits (in split order) * s_w[n] (* s_x[m] when x was FP8 with one
    # scale per token: group scales were applied in the GEMM) (+ bias[n], in fp32)
    if LAUNCH_DEPENDENTS:  # y's reader (a norm, RoPE: interpreter.pdl_chained) may launch now; it waits for y
        gdc_launch_dependents()
    m, pid = tl.program_id(0), tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    s_w = tl.load(sw_ptr + offs, mask=mask, other=0.0)  # the weight's scales and bias: no kernel writes them
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()  # launched behind the GEMM with PDL: every partial written and visible past here
    # s_x only after the wait: the kernel that wrote it is the GEMM's producer, which may still be running when
    # the GEMM releases this one (it does so as it starts, before its own wait). Read before, it gave wrong FP8
    # logits on an H200 once that producer itself waited in a PDL chain (results/fp8/nvidia_h200/pdl_chain/).
    s_x = tl.load(sx_ptr + m * stride_sx) if X_FP8 else 1.0
    row = part_ptr + m * N + offs
    acc = tl.load(row, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(row + s * stride_ps, mask=mask, other=0.0)
    y = acc * s_w
    if X_FP8:
        y = y * s_x
    if HAS_BIAS:
        y += bias
    tl.store(y_ptr + m * stride_ym + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def fp8_decode_mm(q_x: torch.Tensor, s_x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor,
                  split_k: int | None = None, config: tuple[int, int, int, int, int] | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """(q_x @ q_w.T) * s_x * s_w (+ bias) as bf16 [M, N], for 1 <= M <= MAX_M tokens.

    q_x: [M, K] fp8 e4m3, rows K-contiguous; s_x: [M, 1] (or [M]) fp32, one scale per token, or [M, G] (G > 1),
    one per token and group of K / G consecutive columns (`group_scales_fit` says where the kernel takes them);
    q_w: [N, K] fp8, rows K-contiguous; s_w: [N] fp32; bias: [N], added in fp32 before the bf16 rounding.
    split_k: override the configuration's SPLIT_K (tests); config: the whole (BLOCK_N, BLOCK_K, SPLIT_K,
    num_warps, num_stages) instead of the table's (bench/fp8_decode_sweep.py)."""
    _check_operands("fp8_decode_mm", q_x, q_w, s_w, bias)
    (m, k), n = q_x.shape, q_w.shape[0]
    if q_x.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_decode_mm needs float8_e4m3fn operands, got {q_x.dtype} and {q_w.dtype}")
    groups = s_x.shape[1] if s_x.dim() == 2 else 1
    if s_x.dtype != torch.float32 or s_x.numel() != m * groups or s_x.shape[0] != m or k % groups:
        raise ValueError(f"fp8_decode_mm needs fp32 scales s_x [{m}, 1] or [{m}, G] with G dividing K={k}, and "
                         f"s_w [{n}], got {tuple(s_x.shape)} {s_x.dtype} and {tuple(s_w.shape)} {s_w.dtype}")
    if groups > 1:
        block_k = (config or decode_config(n, k))[1]
        if (k // groups) % block_k:
            raise ValueError(f"fp8_decode_mm: scale groups of {k // groups} columns are not whole K tiles of "
                             f"{block_k} (group_scales_fit)")
        return _launch(q_x, s_x.contiguous(), q_w, s_w, torch.bfloat16, split_k, config, bias,
                       group_tiles=k // groups // block_k)
    return _launch(q_x, s_x.reshape(m), q_w, s_w, torch.bfloat16, split_k, config, bias)


def group_scales_fit(n: int, k: int, groups: int) -> bool:
    """Whether fp8_decode_mm takes an [N, K] weight's activation with `groups` scales per token: each group
    whole K tiles of the launch table's BLOCK_K (a group of 7 heads of 128 is 7 tiles of 128)."""
    return groups >= 1 and k % groups == 0 and (k // groups) % decode_config(n, k)[1] == 0


def fp8w_decode_mm(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor, split_k: int | None = None,
                   config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x @ (q_w * s_w[:, None]).T in x's dtype [M, N], for 1 <= M <= MAX_M tokens: the FP8 weight
    widened to x's 16-bit type tile by tile in registers, x itself never quantized.

    Why: at decode sizes the GEMM streams the weight and the tokens are few, so a 16-bit wgmma costs
    no more than an FP8 one, while quantizing x per token costs a launch (or a fused producer's
    extra pass) per projection and rounds the activation to 3 mantissa bits. The weight's bytes, what
    the step's time is made of, stay FP8. x: [M, K] bf16 or fp16, rows K-contiguous; the rest as
    fp8_decode_mm."""
    _check_operands("fp8w_decode_mm", x, q_w, s_w)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8w_decode_mm needs x in bfloat16 or float16, got {x.dtype}")
    return _launch(x, None, q_w, s_w, x.dtype, split_k, config)


def _check_operands(name: str, x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor,
                    bias: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or q_w.dim() != 2 or x.shape[1] != q_w.shape[1]:
        raise ValueError(f"{name} needs x [M, K] and q_w [N, K], got {tuple(x.shape)} and {tuple(q_w.shape)}")
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"{name} serves 1..{MAX_M} tokens, got M={x.shape[0]}")
    if q_w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} needs float8_e4m3fn operands, got {x.dtype} and {q_w.dtype}")
    if x.stride(1) != 1 or q_w.stride(1) != 1:
        raise ValueError(f"{name} needs K-contiguous rows, got strides {x.stride()} and {q_w.stride()}")
    if s_w.shape != (q_w.shape[0],) or s_w.dtype != torch.float32:
        raise ValueError(f"{name} needs fp32 scales s_w [{q_w.shape[0]}], got {tuple(s_w.shape)} {s_w.dtype}")
    if bias is not None and (bias.shape != (q_w.shape[0],) or bias.device != q_w.device):
        raise ValueError(f"{name} needs a bias [{q_w.shape[0]}] on {q_w.device}, got {tuple(bias.shape)} on {bias.device}")


def _launch(x, s_x, q_w, s_w, out_dtype, split_k, config, bias=None, group_tiles: int = 0) -> torch.Tensor:
    """The GEMM (and, split over K, the reduction); s_x None: x is 16-bit (fp8w_decode_mm); group_tiles > 0:
    s_x [M, G] holds a scale per group of that many K tiles."""
    (m, k), n = x.shape, q_w.shape[0]
    block_n, block_k, split, warps, stages = config or decode_config(n, k, split_k, weight_only=s_x is None)
    k_tiles = triton.cdiv(k, block_k)
    if config and not (block_n in BLOCK_NS and block_k in (64, 128, 256) and 1 <= split <= k_tiles):
        raise ValueError(f"fp8_decode_mm config {config}: BLOCK_N must be one of {BLOCK_NS}, BLOCK_K 64, 128 or 256 "
                         f"and SPLIT_K 1..{k_tiles} (K's tiles)")
    block_m = max(16, triton.next_power_of_2(m))
    k_tiles = triton.cdiv(k_tiles, split)  # per split
    if group_tiles:  # a split holds whole groups: its tiles rounded up to them (the 7B's o_proj: 7 = 7)
        k_tiles = triton.cdiv(k_tiles, group_tiles) * group_tiles
        split = triton.cdiv(triton.cdiv(k, block_k), k_tiles)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    x_fp8 = s_x is not None
    s_x = s_x if x_fp8 else s_w  # a pointer the kernels never read when x is 16-bit
    bias_arg = s_w if bias is None else bias  # likewise without a bias
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    pdl = split > 1 and pdl_available(x.device)
    chain = pdl_chained(x.device)  # y's reader launched behind: let it launch early (its own wait keeps y safe)
    trigger = pdl or (chain and UNSPLIT_RELEASE)  # an unsplit GEMM's reader is the next kernel itself
    wait = GEMM_PDL and pdl_available(x.device)  # launched behind x's producer, its weight prefetched meanwhile
    _fp8_decode_gemm_kernel[(triton.cdiv(n, block_n), split)](
        x, q_w, s_x, s_w, bias_arg, out, m, n, k, x.stride(0), q_w.stride(0), s_x.stride(0),
        out.stride(0) if split > 1 else 0, n, K_TILES_PER_SPLIT=k_tiles, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT=split > 1, UPCAST_DOT=interpreted(), LAUNCH_DEPENDENTS=trigger, X_FP8=x_fp8,
        WAIT_FOR_INPUTS=wait, PREFETCH_LINES=min(PREFETCH_TILES, k_tiles) * block_k // 128 if wait else 1,
        GROUP_TILES=group_tiles, HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages,
        **pdl_launch(wait))
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _fp8_decode_gemm_reduce_kernel[(m, triton.cdiv(n, block))](out, s_x, s_w, bias_arg, y, n, out.stride(0),
                                                                   s_x.stride(0), y.stride(0), SPLIT_K=split,
                                                                   BLOCK=block, PDL=pdl,
                                                                   X_FP8=x_fp8 and not group_tiles,
                                                                   HAS_BIAS=bias is not None,
                                                                   LAUNCH_DEPENDENTS=chain, num_warps=4,
                                                                   **pdl_launch(pdl))
    return y


def fp8_decode_mm_ref(q_x: torch.Tensor, s_x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 product of the dequantized operands (+ bias) (the test oracle), [M, N] fp32; s_x per token or
    per (token, group of columns) as fp8_decode_mm takes it."""
    y = dequantize_rows(q_x, s_x) @ (q_w.float() * s_w.float()[:, None]).T
    return y if bias is None else y + bias.float()


def dequantize_rows(q_x: torch.Tensor, s_x: torch.Tensor) -> torch.Tensor:
    """q_x [M, K] fp8 times its scales, [M, 1] (or [M]) or [M, G] (each over K / G consecutive columns): fp32."""
    m, k = q_x.shape
    s = s_x.reshape(m, -1).float()
    return (q_x.float().reshape(m, s.shape[1], -1) * s[:, :, None]).reshape(m, k)


def fp8w_decode_mm_ref(x: torch.Tensor, q_w: torch.Tensor, s_w: torch.Tensor) -> torch.Tensor:
    """fp8w_decode_mm's oracle: x (as it is) times the dequantized weight in fp32, [M, N] fp32."""
    return x.float() @ (q_w.float() * s_w.float()[:, None]).T
