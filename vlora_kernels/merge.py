"""One-shot merge / unmerge of one LoRA adapter into the base weights of every layer, in place.

Switching inference modes (unmerged <-> merged <-> mixture) folds one pool slot into, or out of,
every layer's base weights. One `addmm_` per layer and projection launches hundreds of kernels
and moves each weight about twice; here one launch per projection group (one kind of projection
stacked over all L layers; fused q/k/v or gate/up cut into slices by `slice_offsets`) streams
each affected weight tile exactly once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .interpreter import interpreted

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _load_b_part(b_rows, rows, rank, stride_br, R_START: tl.constexpr, WIDTH: tl.constexpr,
                 UPCAST_DOT: tl.constexpr):
    # b_rows: [BLOCK_N] pointers to B[l, slot, n, 0] -> [BLOCK_N, WIDTH] = B[rows, R_START:R_START+WIDTH]
    offs_r = R_START + tl.arange(0, WIDTH)
    b = tl.load(b_rows[:, None] + offs_r[None, :] * stride_br,
                mask=rows[:, None] & (offs_r < rank)[None, :], other=0.0)
    if UPCAST_DOT:  # see vlora_kernels.interpreter
        b = b.to(tl.float32)
    return b


@triton.jit
def _dot_part(acc, b, a_base, rank, offs_k, mask_k, stride_ar, stride_ak, R_START: tl.constexpr,
              WIDTH: tl.constexpr, UPCAST_DOT: tl.constexpr):
    # acc: [BLOCK_N, BLOCK_K] += b @ A[R_START:R_START+WIDTH, offs_k]
    offs_r = R_START + tl.arange(0, WIDTH)
    a = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                mask=(offs_r < rank)[:, None] & mask_k[None, :], other=0.0)
    if UPCAST_DOT:
        a = a.to(tl.float32)
    return tl.dot(b, a, acc, input_precision="ieee")  # ieee: fp32 pools stay exact


@triton.jit
def _merge_rows(w_ptrs, b_rows, a_base, rows, rank, scale, k_start, k_end,
                stride_wk, stride_ak, stride_br, stride_ar, N_STEPS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr):
    # The rank rounded up to 16 columns (N_STEPS x 16) splits into power-of-two parts, 48 = 32 + 16:
    # every dot is a legal tile, none reaches past the rank's last 16-column step, and B's parts
    # are loaded once per strip, before the k loop that streams the weight and A.
    W4: tl.constexpr = 16 * (N_STEPS & 16)
    W3: tl.constexpr = 16 * (N_STEPS & 8)
    W2: tl.constexpr = 16 * (N_STEPS & 4)
    W1: tl.constexpr = 16 * (N_STEPS & 2)
    W0: tl.constexpr = 16 * (N_STEPS & 1)
    S2: tl.constexpr = W4 + W3  # first rank column of part W2, and so on
    S1: tl.constexpr = S2 + W2
    S0: tl.constexpr = S1 + W1
    if W4 > 0:
        b4 = _load_b_part(b_rows, rows, rank, stride_br, 0, W4, UPCAST_DOT)
    if W3 > 0:
        b3 = _load_b_part(b_rows, rows, rank, stride_br, W4, W3, UPCAST_DOT)
    if W2 > 0:
        b2 = _load_b_part(b_rows, rows, rank, stride_br, S2, W2, UPCAST_DOT)
    if W1 > 0:
        b1 = _load_b_part(b_rows, rows, rank, stride_br, S1, W1, UPCAST_DOT)
    if W0 > 0:
        b0 = _load_b_part(b_rows, rows, rank, stride_br, S0, W0, UPCAST_DOT)
    offs_k0 = tl.arange(0, BLOCK_K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + offs_k0
        mask_k = offs_k < k_end
        mask_w = rows[:, None] & mask_k[None, :]
        w = tl.load(w_ptrs + k0 * stride_wk, mask=mask_w, other=0.0)  # [BLOCK_N, BLOCK_K]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if W4 > 0:
            acc = _dot_part(acc, b4, a_base, rank, offs_k, mask_k, stride_ar, stride_ak, 0, W4, UPCAST_DOT)
        if W3 > 0:
            acc = _dot_part(acc, b3, a_base, rank, offs_k, mask_k, stride_ar, stride_ak, W4, W3, UPCAST_DOT)
        if W2 > 0:
            acc = _dot_part(acc, b2, a_base, rank, offs_k, mask_k, stride_ar, stride_ak, S2, W2, UPCAST_DOT)
        if W1 > 0:
            acc = _dot_part(acc, b1, a_base, rank, offs_k, mask_k, stride_ar, stride_ak, S1, W1, UPCAST_DOT)
        if W0 > 0:
            acc = _dot_part(acc, b0, a_base, rank, offs_k, mask_k, stride_ar, stride_ak, S0, W0, UPCAST_DOT)
        out = (w.to(tl.float32) + scale * acc).to(w_ptrs.dtype.element_ty)  # rounded once
        tl.store(w_ptrs + k0 * stride_wk, out, mask=mask_w)


@triton.jit(do_not_specialize=["slot"])  # one binary for every slot
def _merge_lora_kernel(
    w_ptr, a_ptr, b_ptr, ranks_ptr, scales_ptr, offsets_ptr,
    N, K, slot, sign, k_per_program,
    stride_wl, stride_wn, stride_wk,
    stride_al, stride_ai, stride_as, stride_ar, stride_ak,
    stride_bl, stride_bs, stride_bn, stride_br,
    stride_rank_i, stride_rank_s,
    R_MAX: tl.constexpr, N_SLICES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N) * cdiv(K, k_per_program), L): each program streams a strip of
    # BLOCK_N rows x k_per_program columns of one layer's weight, BLOCK_K columns at a time.
    pid = tl.program_id(0)
    pid_l = tl.program_id(1).to(tl.int64)  # L * N * K can pass 2**31 (7B gate_up: 2.9e9)
    num_pid_k = tl.cdiv(K, k_per_program)
    pid_n = pid // num_pid_k
    k_start = (pid % num_pid_k) * k_per_program
    k_end = tl.minimum(k_start + k_per_program, K)
    n_start = pid_n * BLOCK_N
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    slot64 = slot.to(tl.int64)
    w_ptrs = w_ptr + pid_l * stride_wl + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    b_rows = b_ptr + pid_l * stride_bl + slot64 * stride_bs + offs_n * stride_bn
    scale = tl.load(scales_ptr + slot) * sign

    # A strip may straddle slices (q|k|v): it is merged once per slice it overlaps, each pass
    # touching only that slice's rows, so no byte moves twice and untargeted rows (rank 0, e.g. k
    # when only q/v carry LoRA) are never read or written.
    for i in tl.static_range(N_SLICES):
        lo = tl.load(offsets_ptr + i)
        hi = tl.load(offsets_ptr + i + 1)
        rank = tl.minimum(tl.load(ranks_ptr + i * stride_rank_i + slot * stride_rank_s), R_MAX)
        rows = (offs_n >= lo) & (offs_n < hi) & (offs_n < N)
        overlaps = (lo < n_start + BLOCK_N) & (hi > n_start) & (rank > 0)
        n_steps = tl.where(overlaps, tl.cdiv(rank, 16), 0)
        a_base = a_ptr + pid_l * stride_al + i * stride_ai + slot64 * stride_as
        # One branch per rank rounded up to 16 columns: the step count is static inside, so the
        # dots have fixed shapes and the k loop stays innermost for the pipeliner.
        for steps in tl.static_range(1, (R_MAX + 15) // 16 + 1):
            if n_steps == steps:
                _merge_rows(w_ptrs, b_rows, a_base, rows, rank, scale, k_start, k_end,
                            stride_wk, stride_ak, stride_br, stride_ar, steps, BLOCK_N, BLOCK_K, UPCAST_DOT)


@functools.lru_cache(maxsize=256)
def _offsets_on_device(offsets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Cached so a list given on every call costs one copy, and replays under graph capture.
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def _as_offsets(slice_offsets, n_total: int, device: torch.device) -> torch.Tensor:
    if isinstance(slice_offsets, torch.Tensor):
        if slice_offsets.dtype != torch.int32 or slice_offsets.dim() != 1:
            raise ValueError(f"slice_offsets must be a 1-D int32 tensor, got {slice_offsets.dtype} "
                             f"of shape {tuple(slice_offsets.shape)}")
        if slice_offsets.device != device:
            raise ValueError(f"slice_offsets is on {slice_offsets.device}; it must be on the weight's "
                             f"device {device} (or be a Python list)")
        return slice_offsets  # values stay unchecked: reading them would force a sync
    offsets = tuple(int(o) for o in slice_offsets)
    if (len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != n_total
            or any(b < a for a, b in zip(offsets, offsets[1:]))):
        raise ValueError(f"slice_offsets must rise from 0 to N_total={n_total}, got {list(offsets)}")
    return _offsets_on_device(offsets, device)


def _default_config(n_total: int, k: int, weight: torch.Tensor) -> dict:
    # Memory-bound streaming, tuned on H200 (LLaVA-7B groups, ranks 8-64): strips of 64 rows x
    # 2048 columns walked 128 columns (256 B a row in 16-bit) at a time, 4 warps, 3 stages; 8
    # warps or 256-wide steps ran 1.5x slower. fp32 weights halve the step to fit registers.
    block_k = min(64 if weight.element_size() == 4 else 128, max(16, triton.next_power_of_2(k)))
    return dict(block_n=min(64, max(16, triton.next_power_of_2(n_total))), block_k=block_k,
                k_per_program=max(block_k, 2048), num_warps=4, num_stages=3)


def merge_lora_(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slot: int,
                ranks: torch.Tensor, scales: torch.Tensor, slice_offsets, sign: int = 1,
                block_n: int | None = None, block_k: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None, k_per_program=None) -> None:
    """Fold pool slot `slot` into (sign=+1) or out of (sign=-1) `weight`, in place, in one launch.

    weight:        [L, N_total, K] contiguous fp16/bf16/fp32 (nn.Linear layout: out x in)
    lora_a:        [L, n_slices, S, R_max, K] (PEFT layout: rank x in)
    lora_b:        [L, S, N_total, R_max]     (out x rank; slices concatenated along N)
    ranks:         [n_slices, S] int32, 0 = slice not targeted by that slot
    scales:        [S] float32 (alpha / r)
    slice_offsets: [n_slices + 1] int32 on weight's device, or a list; 0 ... N_total

        for l in range(L), i in range(n_slices):
            r, lo, hi = ranks[i, slot], slice_offsets[i], slice_offsets[i + 1]
            weight[l, lo:hi] += sign * scales[slot] * lora_b[l, slot, lo:hi, :r] @ lora_a[l, i, slot, :r]

    The product accumulates in fp32 and is added to the weight, rounded once; no delta tensor is
    built. `ranks` and `scales` are read on the device, so the call never syncs and can be
    captured in a CUDA graph (give `slice_offsets` as a device tensor or a list seen before).
    Tiling overrides: rows per strip (block_n), columns per step (block_k), columns per strip
    (k_per_program), num_warps, num_stages; defaults in `_default_config`.
    """
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 (merge) or -1 (unmerge), got {sign!r}")
    if weight.dim() != 3:
        raise ValueError(f"weight must be [L, N_total, K], got shape {tuple(weight.shape)}")
    if weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"weight dtype must be one of {_FLOAT_DTYPES}, got {weight.dtype}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous (it is updated in place as [L, N_total, K])")
    n_layers, n_total, k = weight.shape
    if lora_a.dim() != 5 or lora_a.shape[0] != n_layers or lora_a.shape[-1] != k:
        raise ValueError(f"lora_a must be [L={n_layers}, n_slices, S, R_max, K={k}], "
                         f"got shape {tuple(lora_a.shape)}")
    _, n_slices, n_slots, r_max, _ = lora_a.shape
    if r_max > 496:  # five power-of-two parts of 16..256 columns
        raise ValueError(f"lora_a's R_max must be at most 496, got {r_max}")
    if tuple(lora_b.shape) != (n_layers, n_slots, n_total, r_max):
        raise ValueError(f"lora_b must be [L, S, N_total, R_max] = {(n_layers, n_slots, n_total, r_max)}, "
                         f"got shape {tuple(lora_b.shape)}")
    if lora_a.dtype not in _FLOAT_DTYPES or lora_b.dtype != lora_a.dtype:
        raise ValueError(f"lora_a and lora_b must share one dtype of {_FLOAT_DTYPES}, "
                         f"got {lora_a.dtype} and {lora_b.dtype}")
    if tuple(ranks.shape) != (n_slices, n_slots) or ranks.dtype != torch.int32:
        raise ValueError(f"ranks must be int32 [n_slices, S] = {(n_slices, n_slots)}, "
                         f"got {ranks.dtype} of shape {tuple(ranks.shape)}")
    if tuple(scales.shape) != (n_slots,) or scales.dtype != torch.float32:
        raise ValueError(f"scales must be float32 [S] = {(n_slots,)}, "
                         f"got {scales.dtype} of shape {tuple(scales.shape)}")
    for name, t in (("lora_a", lora_a), ("lora_b", lora_b), ("ranks", ranks), ("scales", scales)):
        if t.device != weight.device:
            raise ValueError(f"{name} is on {t.device}; it must be on the weight's device {weight.device}")
    if not 0 <= slot < n_slots:
        raise ValueError(f"slot must be in [0, {n_slots}) for a pool of S={n_slots} slots, got {slot}")
    offsets = _as_offsets(slice_offsets, n_total, weight.device)
    if offsets.numel() != n_slices + 1:
        raise ValueError(f"slice_offsets must hold n_slices + 1 = {n_slices + 1} entries, "
                         f"got {offsets.numel()}")
    if weight.numel() == 0 or r_max == 0:
        return

    cfg = _default_config(n_total, k, weight)
    block_n = block_n or cfg["block_n"]
    block_k = block_k or cfg["block_k"]
    k_per_program = k_per_program or cfg["k_per_program"]
    grid = (triton.cdiv(n_total, block_n) * triton.cdiv(k, k_per_program), n_layers)
    _merge_lora_kernel[grid](
        weight, lora_a, lora_b, ranks, scales, offsets,
        n_total, k, slot, float(sign), k_per_program,
        *weight.stride(), *lora_a.stride(), *lora_b.stride(), *ranks.stride(),
        R_MAX=r_max, N_SLICES=n_slices, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST_DOT=interpreted(),
        num_warps=num_warps or cfg["num_warps"], num_stages=num_stages or cfg["num_stages"],
    )


def unmerge_lora_(weight, lora_a, lora_b, slot, ranks, scales, slice_offsets, **config) -> None:
    """`merge_lora_` with sign=-1: subtract slot `slot`'s product from `weight` again."""
    merge_lora_(weight, lora_a, lora_b, slot, ranks, scales, slice_offsets, sign=-1, **config)


def merge_lora_ref_(weight, lora_a, lora_b, slot, ranks, scales, slice_offsets, sign: int = 1,
                    block_n=None, block_k=None, num_warps=None, num_stages=None) -> None:
    """Plain PyTorch `merge_lora_`: per layer and slice, an fp32 addmm rounded once, in place."""
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 (merge) or -1 (unmerge), got {sign!r}")
    offsets = [int(o) for o in (slice_offsets.tolist() if torch.is_tensor(slice_offsets) else slice_offsets)]
    rank_table, alpha = ranks.tolist(), sign * float(scales[slot])
    for i, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        r = min(rank_table[i][slot], lora_a.shape[3])
        if r <= 0 or hi == lo:
            continue
        for layer in range(weight.shape[0]):
            rows = weight[layer, lo:hi]  # [N_i, K]
            b = lora_b[layer, slot, lo:hi, :r].float()  # [N_i, r]
            a = lora_a[layer, i, slot, :r].float()  # [r, K]
            rows.copy_(rows.float().addmm_(b, a, alpha=alpha))


@dataclass
class MergeGroup:
    """One projection kind over all layers, with its adapter pools (shapes as in `merge_lora_`)."""

    weight: torch.Tensor  # [L, N_total, K]
    lora_a: torch.Tensor  # [L, n_slices, S, R_max, K]
    lora_b: torch.Tensor  # [L, S, N_total, R_max]
    ranks: torch.Tensor  # [n_slices, S] int32
    scales: torch.Tensor  # [S] float32
    slice_offsets: torch.Tensor | Sequence[int]  # [n_slices + 1]


def merge_groups_(groups: Sequence[MergeGroup], slot: int, sign: int = 1) -> None:
    """Merge (sign=+1) or unmerge (sign=-1) slot `slot` into every group: one launch per group."""
    for g in groups:
        merge_lora_(g.weight, g.lora_a, g.lora_b, slot, g.ranks, g.scales, g.slice_offsets, sign=sign)


def merge_floor_bytes(groups: Sequence[MergeGroup | tuple], slot: int | None = None) -> int:
    """Bytes a merge must move at least: each affected weight element read and written once, plus
    the A and B factors read once.

    Items are `MergeGroup`s or shape tuples `(L, slice_widths, K, rank, weight_bytes, lora_bytes)`.
    For a group with `slot` given, only slices that slot targets count, at their real rank (this
    reads `ranks` on the host); without `slot`, every slice counts at R_max.
    """
    total = 0
    for g in groups:
        if isinstance(g, MergeGroup):
            n_layers, _, k = g.weight.shape
            offs = g.slice_offsets.tolist() if torch.is_tensor(g.slice_offsets) else list(g.slice_offsets)
            widths = [b - a for a, b in zip(offs, offs[1:])]
            r_max = g.lora_a.shape[3]
            slice_ranks = ([min(int(r), r_max) for r in g.ranks[:, slot].tolist()] if slot is not None
                           else [r_max] * len(widths))
            w_bytes, l_bytes = g.weight.element_size(), g.lora_a.element_size()
        else:
            n_layers, widths, k, rank, w_bytes, l_bytes = g
            slice_ranks = [rank] * len(widths)
        for width, r in zip(widths, slice_ranks):
            if r > 0:
                total += n_layers * (2 * width * k * w_bytes + (width + k) * r * l_bytes)
    return total
