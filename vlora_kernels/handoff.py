"""ATMM in one launch for decode-sized batches, with the shrink handing v to the expand in-launch.

    one launch of S + E programs; each takes a ticket from a counter as it starts:
        tickets 0 .. S-1:  a shrink work item (segment, token tile, slice, K split):
                           v[j, i, tokens, :r] = x[tokens, kj] @ A[i, s, :r, kj].T, then `done` += 1
        tickets S .. S+E-1: an expand work item (segment, token tile, slice, column group):
                           wait until `done` == S, then y[tokens, group] += scale[s] * sum_j(v[j]) @ B[s].T

At decode the two-launch op (`lora.py`) costs two dependent kernels even with programmatic
dependent launch (5.1-6.0 us at one token on an H100, against a floor of well under 1 us), and
the fused kernel (`fused.py`), which saves the second launch by having every program recompute
v over the whole K alone, lost at every decode shape timed. Here the work is split as in the two
launches (split-K shrink programs, column-group expand programs) and only the launch boundary is
replaced by a counter in global memory.

Why it cannot deadlock: programs take tickets in the order they start running, so every shrink
ticket belongs to a program that is already resident, and shrink programs never wait. An expand
program waits only for those. (Indexing work by program id instead would let expand programs
fill the GPU while shrink programs they wait for are still unscheduled, unless the whole grid
fits on the GPU at once: `roles_by_id`, where the launch does so by default.) In Triton's interpreter
programs run one after another in ticket order, so the wait is always already satisfied there.

The handoff: a shrink program stores its v tile, synchronizes its threads, and increments
`done` with release semantics; an expand program spins on `done` with acquire semantics, then
reads v through L2 (`.cg`: never a stale L1 line of a v buffer reused across layers). An expand
item issues its y, B and scale loads before the wait. The last expand program to finish resets
the three counters to zero, so the next launch on the stream
starts from zero (launches on one stream run one after another; nothing here triggers an early
dependent launch). A launch that dies part way leaves them non-zero: `reset_counters` clears them.

v is the two launches' layout, float32 [splits, slices, tokens, max_rank], written by exactly one
program per (split, slice, token, rank column < rank16): no zeroing and no atomics on data. A's
rows are masked at the exact rank, so v is zero past it and B's columns past the rank (read to
rank16) only meet zeros. Mixture batches are refused (as `fused.py`, never sent here by
`add_lora`).

The wait itself cannot be exercised by the interpreter's one-program-at-a-time order; the GPU
tests run the kernel compiled, where shrink and expand programs do run side by side.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .expand import column_groups, slice_offsets
from .fused import check_one_launch_inputs
from .interpreter import dot_nt, interpreted
from .segments import SegmentMeta
from .shrink import k_step
from .tiling import HANDOFF_MAX_TOKENS, TileConfig, next_pow2

LINE = 32  # int32 per 128-byte cache line: the counters' spacing


@triton.jit
def _item(item, inner, n_slices, n_m_tiles, token_order_ptr, seg_slot_ptr, seg_start_ptr, seg_len_ptr, ranks_ptr,
          stride_ranks_i, BLOCK_M: tl.constexpr):
    """Work item `item` of (segment, token tile, slice, inner), inner fastest: (inner index,
    slice, tokens, mask_m, slot, rank, live). rank is 0 for padding segments; live when the
    tile holds tokens of an adapter with a rank."""
    j = item % inner
    rest = item // inner
    i = rest % n_slices
    rest = rest // n_slices
    seg = rest // n_m_tiles
    m = rest % n_m_tiles
    seg_len = tl.load(seg_len_ptr + seg)
    seg_start = tl.load(seg_start_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg)
    rank = tl.load(ranks_ptr + i * stride_ranks_i + tl.maximum(slot, 0))
    rank = tl.where(slot >= 0, rank, 0)
    offs_m = m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    tokens = tl.load(token_order_ptr + seg_start + offs_m, mask=mask_m, other=0).to(tl.int64)
    return j, i, tokens, mask_m, tl.maximum(slot, 0), rank, (m * BLOCK_M < seg_len) & (rank > 0)


@triton.jit
def _wait_for_shrinks(counters_ptr, n_shrink, SPIN_LIMIT: tl.constexpr, LINE: tl.constexpr):
    """Spin until every shrink item has counted itself done (acquire: its v stores are then
    visible). SPIN_LIMIT > 0 bounds the spin (the interpreter, where a wait that is not already
    over would never end)."""
    spins = 0
    while (tl.atomic_add(counters_ptr + LINE, 0, sem="acquire") < n_shrink) & ((SPIN_LIMIT == 0) | (spins < SPIN_LIMIT)):
        spins += 1
    if SPIN_LIMIT > 0:
        tl.device_assert(spins < SPIN_LIMIT, "an expand item ran before every shrink item had finished")


@triton.jit
def _handoff_kernel(
    x_ptr, a_ptr, b_ptr, y_ptr, v_ptr, counters_ptr,
    token_order_ptr, seg_slot_ptr, seg_start_ptr, seg_len_ptr, ranks_ptr, scales_ptr, slice_offsets_ptr,
    K, k_per_split, n_m_tiles, n_slices, n_col_groups, n_shrink, n_expand,
    stride_xt, stride_xk,
    stride_ai, stride_as, stride_ar, stride_ak,
    stride_bs, stride_bn, stride_br,
    stride_yt, stride_yn,
    stride_vj, stride_vi, stride_vt, stride_vr,
    stride_ranks_i,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    SPLIT_K: tl.constexpr, COL_TILES: tl.constexpr, UPCAST_DOT: tl.constexpr, EVEN_K: tl.constexpr,
    SLICES_MULT16: tl.constexpr, SPIN_LIMIT: tl.constexpr, TICKETS: tl.constexpr, LINE: tl.constexpr,
):
    # counters: tickets, shrink items done, expand items done, LINE int32 apart (`counters`)
    if TICKETS:
        ticket = tl.atomic_add(counters_ptr, 1)
    else:  # roles by program id: see `handoff_add_lora`'s `tickets`
        ticket = tl.program_id(0)
    offs_r = tl.arange(0, BLOCK_R)
    if ticket < n_shrink:
        j, i, tokens, mask_m, slot, rank, live = _item(ticket, SPLIT_K, n_slices, n_m_tiles, token_order_ptr,
                                                       seg_slot_ptr, seg_start_ptr, seg_len_ptr, ranks_ptr,
                                                       stride_ranks_i, BLOCK_M)
        if live:
            # Rows of A are masked at the exact rank, so v is exactly zero past it whatever the
            # pool holds there; v is stored up to rank16, the bound the expand reads it to.
            mask_a = offs_r < rank
            mask_r = offs_r < (rank + 15) // 16 * 16
            k_start = j * k_per_split
            k_end = tl.minimum(K, k_start + k_per_split)
            offs_k = tl.arange(0, BLOCK_K)
            x_ptrs = x_ptr + tokens[:, None] * stride_xt + (k_start + offs_k)[None, :] * stride_xk
            a_ptrs = (a_ptr + i.to(tl.int64) * stride_ai + slot.to(tl.int64) * stride_as
                      + offs_r[:, None] * stride_ar + (k_start + offs_k)[None, :] * stride_ak)
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k in range(k_start, k_end, BLOCK_K):
                x = k_step(x_ptrs, mask_m, k + offs_k, k_end, EVEN_K)
                acc = dot_nt(acc, x, k_step(a_ptrs, mask_a, k + offs_k, k_end, EVEN_K), UPCAST_DOT)
                x_ptrs += BLOCK_K * stride_xk
                a_ptrs += BLOCK_K * stride_ak
            v_ptrs = v_ptr + j * stride_vj + i * stride_vi + tokens[:, None] * stride_vt + offs_r[None, :] * stride_vr
            tl.store(v_ptrs, acc, mask=mask_m[:, None] & mask_r[None, :])
        tl.debug_barrier()  # every thread's v stores are issued before the one release below
        tl.atomic_add(counters_ptr + LINE, 1, sem="release")
    else:
        c, i, tokens, mask_m, slot, rank, live = _item(ticket - n_shrink, n_col_groups, n_slices, n_m_tiles,
                                                       token_order_ptr, seg_slot_ptr, seg_start_ptr, seg_len_ptr,
                                                       ranks_ptr, stride_ranks_i, BLOCK_M)
        col_start = tl.load(slice_offsets_ptr + i)
        col_end = tl.load(slice_offsets_ptr + i + 1)
        if SLICES_MULT16:
            col_start = tl.multiple_of(col_start, 16)
            col_end = tl.multiple_of(col_end, 16)
        first = col_start + c * (BLOCK_N * COL_TILES)
        if live & (first < col_end):
            offs_n = first + tl.arange(0, BLOCK_N)
            y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :] * stride_yn
            mask_y = mask_m[:, None] & (offs_n < col_end)[None, :]
            # y, B and the scale do not depend on v: their loads are issued before the wait, so
            # after it only v's load stands between the handoff and the product.
            y = tl.load(y_ptrs, mask=mask_y, other=0.0)
            scale = tl.load(scales_ptr + slot)
            b_ptrs = (b_ptr + slot.to(tl.int64) * stride_bs + offs_n[:, None].to(tl.int64) * stride_bn
                      + offs_r[None, :] * stride_br)  # rows of B, read to rank16 (zeros past the rank in v)
            mask_b_r = (offs_r < (rank + 15) // 16 * 16)[None, :]
            b = tl.load(b_ptrs, mask=(offs_n < col_end)[:, None] & mask_b_r, other=0.0)
            _wait_for_shrinks(counters_ptr, n_shrink, SPIN_LIMIT, LINE)
            rank16 = (rank + 15) // 16 * 16
            v_ptrs = v_ptr + i * stride_vi + tokens[:, None] * stride_vt + offs_r[None, :] * stride_vr
            mask_v = mask_m[:, None] & (offs_r < rank16)[None, :]
            v = tl.load(v_ptrs, mask=mask_v, other=0.0, cache_modifier=".cg")
            for jj in range(1, SPLIT_K):
                v += tl.load(v_ptrs + jj * stride_vj, mask=mask_v, other=0.0, cache_modifier=".cg")
            v = v.to(b_ptr.dtype.element_ty)  # rounded to the weights' dtype, as the two launches do
            for t in range(COL_TILES):  # each tile's y and B loaded one step ahead of its product
                acc = dot_nt(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), v, b, UPCAST_DOT) * scale
                out = (y.to(tl.float32) + acc).to(y.dtype)
                next_n = offs_n + BLOCK_N
                more = (next_n < col_end) & (t + 1 < COL_TILES)
                mask_next = mask_m[:, None] & more[None, :]
                y_next = tl.load(y_ptrs + BLOCK_N * stride_yn, mask=mask_next, other=0.0)
                b = tl.load(b_ptrs + BLOCK_N * stride_bn, mask=more[:, None] & mask_b_r, other=0.0)
                tl.store(y_ptrs, out, mask=mask_y)
                y, y_ptrs, mask_y, offs_n, b_ptrs = y_next, y_ptrs + BLOCK_N * stride_yn, mask_next, next_n, \
                    b_ptrs + BLOCK_N * stride_bn
        tl.debug_barrier()  # this program's y stores are issued before it counts itself done
        if tl.atomic_add(counters_ptr + 2 * LINE, 1, sem="acq_rel") == n_expand - 1:
            # The last expand item: every ticket is taken. Every shrink item has counted itself
            # too once this wait is over (expand items with nothing to do, such as those of an
            # untargeted slice, do not wait, so all of them may end before a shrink item counts);
            # then nothing else touches the counters in this launch.
            _wait_for_shrinks(counters_ptr, n_shrink, SPIN_LIMIT, LINE)
            # Plain stores: no program of this launch reads them again, and the next launch on
            # the stream starts only after this one has ended, when they are visible.
            tl.store(counters_ptr + tl.arange(0, 4) * LINE, tl.zeros((4,), dtype=tl.int32), mask=tl.arange(0, 4) < 3)


_COUNTERS: dict[tuple, torch.Tensor] = {}
_V: dict[tuple, torch.Tensor] = {}


def _stream(device: torch.device) -> tuple:
    return str(device), torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0


def _created(device: torch.device, what: str, make):
    """A new cache entry, outside CUDA-graph capture: made inside, its memory would belong to the
    graph's private pool. A launch on the capturing stream before capture creates it."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"handoff_add_lora: no {what} for this stream yet, and it is being captured into a "
                           "CUDA graph; run one launch on the capturing stream before capture")
    return make()


def counters(device: torch.device) -> torch.Tensor:
    """The launch's three counters on `device` for the current stream, int32 [3, LINE] (each in
    column 0 of its own 128-byte line: every program's ticket, every shrink item's release and
    every waiting expand item's polls would otherwise all queue on one L2 line), zeroed once and
    left zero by every launch that completes. Per stream, so launches on two streams never share
    them; cached, so a CUDA graph keeps one address."""
    key = _stream(device)
    if key not in _COUNTERS:
        _COUNTERS[key] = _created(device, "counters", lambda: torch.zeros(3, LINE, dtype=torch.int32, device=device))
    return _COUNTERS[key]


def reset_counters() -> None:
    """Zero every cached counter (after a launch that failed part way)."""
    for t in _COUNTERS.values():
        t.zero_()


def _workspace(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The float32 v of one shape for the current stream (per stream, as the counters: two
    streams' launches never write one v)."""
    key = (shape, *_stream(device))
    if key not in _V:
        _V[key] = _created(device, "v workspace", lambda: torch.empty(shape, dtype=torch.float32, device=device))
    return _V[key]


def roles_by_id(n_programs: int, num_sms: int, per_sm: int = 1) -> bool:
    """Whether programs may take their roles by id without any risk of deadlock: when every
    program of the grid fits on the GPU at once, `per_sm` programs on each SM (a lower bound on
    what an idle SM holds, `resident_per_sm`). Then all of them are resident together once
    whatever else runs on the GPU has ended, whatever order they were dispatched in, and the
    shrink items an expand item waits for always get to run."""
    return n_programs <= num_sms * max(1, per_sm)


# What an SM has, where the device does not say (torch builds before these properties, and the
# interpreter, which then takes an H100's paths): registers, shared memory, threads.
H100_SM = {"regs_per_multiprocessor": 65536, "shared_memory_per_multiprocessor": 233472,
           "max_threads_per_multi_processor": 2048, "multi_processor_count": 132}


def smem_bound(config: TileConfig, block_r: int, elem_bytes: int = 2) -> int:
    """An upper bound on the shared memory of one handoff program: the shrink's pipelined x and A
    tiles, the expand's v and its pipelined B and y tiles, and an fp32 tile of the wider product
    for layout conversions, as though none of them shared memory with another (Triton reuses it
    by liveness, so the kernel takes less; the GPU tests check it against the compiled kernels)."""
    stages, m, n = config.num_stages, config.block_m, config.block_n
    shrink = stages * (m + block_r) * config.block_k * elem_bytes
    expand = (m * block_r + stages * (n * block_r + m * n)) * elem_bytes
    return shrink + expand + m * max(block_r, n) * 4


def resident_per_sm(config: TileConfig, block_r: int, sm: dict, elem_bytes: int = 2) -> int:
    """Programs of one handoff launch that an idle SM holds at once, at least: by registers at
    the most any thread can have (255, allocated per warp in units of 256), by shared memory at
    `smem_bound` plus the 1 KiB the driver keeps per program, and by threads."""
    warps = config.num_warps
    by_regs = sm["regs_per_multiprocessor"] // (256 * 32 * warps)
    by_smem = sm["shared_memory_per_multiprocessor"] // (smem_bound(config, block_r, elem_bytes) + 1024)
    by_threads = sm["max_threads_per_multi_processor"] // (32 * warps)
    return max(1, min(by_regs, by_smem, by_threads))


@functools.lru_cache(maxsize=None)
def _sm_of(index: int) -> dict:
    props = torch.cuda.get_device_properties(index)
    known = {name: getattr(props, name, None) for name in H100_SM}
    if None in known.values():  # an older torch: one program per SM, which holds on any GPU
        return dict(H100_SM, regs_per_multiprocessor=0, multi_processor_count=props.multi_processor_count)
    return known


def _sm(device: torch.device) -> dict:
    """The SM of `device` (the interpreter: an H100's, so that CPU runs take the GPU's paths)."""
    if device.type != "cuda":
        return H100_SM
    return _sm_of(device.index if device.index is not None else torch.cuda.current_device())


def handoff_grid(meta: SegmentMeta, n_slices: int, max_slice: int, k: int,
                 config: TileConfig) -> tuple[int, int, int, int, int]:
    """(shrink items, expand items, K per split, column tiles per group, column groups) of one
    launch, the column groups as `expand` forms them."""
    col_tiles, n_col_groups = column_groups(max_slice, config.block_n, config.col_tiles)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    items = meta.num_segments * triton.cdiv(meta.max_seg_len, config.block_m) * n_slices
    return items * config.split_k, items * n_col_groups, k_per_split, col_tiles, n_col_groups


def handoff_add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, meta: SegmentMeta,
                     ranks: torch.Tensor, scales: torch.Tensor, slices, config: TileConfig,
                     v: torch.Tensor | None = None, tickets: bool | None = None) -> torch.Tensor:
    """`add_lora` in one launch (same arguments and result, y updated in place and returned) for
    decode-sized, plain (non-mixture) batches and pools of max rank <= 128.

    config: block_m tokens per tile, block_k the shrink's K step, split_k its K splits, block_n
    and col_tiles the expand's column tile and tiles per program. v: a float32 workspace of
    [split_k, slices, tokens, max_rank] (default: one cached per shape and device).

    tickets: how programs get their roles. True: from the ticket counter (deadlock-free by
    construction, see above). False: by program id (shrink items the lowest ids), which saves
    the atomic round trip every program starts with, but is deadlock-free only if an expand
    program never occupies the place a shrink program it waits for needs: always true when the
    whole grid fits on the GPU at once, otherwise only while the GPU dispatches programs in id
    order, as NVIDIA GPUs do in practice without promising it. None (the default): by program
    id where the whole grid fits on the GPU at once (`roles_by_id`, `resident_per_sm`), tickets
    otherwise.
    """
    slices = check_one_launch_inputs(y, x, lora_a, lora_b, meta, ranks, scales, slices)
    if meta.mix_slot is not None:
        raise ValueError("handoff_add_lora takes plain batches; a mixture batch goes to add_lora's two launches")
    if meta.num_tokens > HANDOFF_MAX_TOKENS:
        # Past decode sizes the launch may hold more programs than fit on the GPU at once; the
        # tickets keep it correct, but it is neither tuned nor measured there.
        raise ValueError(f"handoff_add_lora is for decode batches of <= {HANDOFF_MAX_TOKENS} tokens, "
                         f"got {meta.num_tokens}")
    if meta.num_segments == 0 or meta.max_seg_len == 0:
        return y
    k = x.shape[1]
    v_shape = (config.split_k, len(slices), x.shape[0], lora_a.shape[2])
    if v is None:
        v = _workspace(v_shape, x.device)
    elif v.dtype != torch.float32 or tuple(v.shape) != v_shape or v.device != x.device:
        raise ValueError(f"v must be float32 {v_shape} on {x.device}, got {v.dtype} {tuple(v.shape)} on {v.device}")
    n_shrink, n_expand, k_per_split, col_tiles, n_col_groups = handoff_grid(meta, len(slices), max(slices), k, config)
    block_r = max(16, next_pow2(lora_a.shape[2]))
    if tickets is None:
        sm = _sm(x.device)
        per_sm = resident_per_sm(config, block_r, sm, x.element_size())
        tickets = not roles_by_id(n_shrink + n_expand, sm["multi_processor_count"], per_sm)
    _launch(
        tickets, (n_shrink + n_expand,), x, lora_a, lora_b, y, v, counters(x.device),
        meta.token_order, meta.seg_slot, meta.seg_start, meta.seg_len, ranks, scales, slice_offsets(slices, y.device),
        k, k_per_split, triton.cdiv(meta.max_seg_len, config.block_m), len(slices), n_col_groups, n_shrink, n_expand,
        x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), lora_a.stride(3),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        y.stride(0), y.stride(1),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        ranks.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        BLOCK_R=block_r, SPLIT_K=config.split_k, COL_TILES=col_tiles,
        UPCAST_DOT=interpreted(), EVEN_K=k % config.block_k == 0 and k_per_split % config.block_k == 0,
        SLICES_MULT16=all(w % 16 == 0 for w in slices), SPIN_LIMIT=1 if interpreted() else 0,
        LINE=LINE, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y


def _launch(tickets: bool, grid: tuple, *args, **meta):
    """One launch of the kernel; returns Triton's compiled kernel (the GPU tests read its
    shared memory from it)."""
    return _handoff_kernel[grid](*args, TICKETS=tickets, **meta)
