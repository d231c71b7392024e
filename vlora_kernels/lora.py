"""The ATMM LoRA op: shrink then expand, tiled per shape from the device's tiling table.

    add_lora(y, x, lora_a, lora_b, meta, ranks, scales, slices)    # y += LoRA(x), in place
    add_lora_beside(base, x, lora_a, ...)    # base(x) + LoRA(x), the shrink concurrent with base

Same signature as the references in `reference.py`, so callers can swap implementations.
Decode-sized batches take a one-launch kernel instead (`fused.py`, or `handoff.py`, where the
shrink hands v to the expand inside the launch) only where the device's table holds an entry of
it measured faster than the two launches at that shape (`TilingTable.one_launch`); shapes the
table never measured, and mixture batches, take the two launches.
On Hopper and newer the expand follows the shrink by programmatic dependent launch (`expand`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .expand import expand
from .fused import fused_add_lora
from .handoff import handoff_add_lora
from .interpreter import pdl_available
from .segments import SegmentMeta
from .shrink import shrink, v_shape
from .table import TilingTable
from .tiling import FUSED_MAX_RANK, HANDOFF_MAX_TOKENS, TileConfig, shape_key


@functools.lru_cache(maxsize=None)
def default_table(device_index: int = 0) -> TilingTable:
    if not torch.cuda.is_available():
        return TilingTable("cpu")
    props = torch.cuda.get_device_properties(device_index)
    return TilingTable.for_device(props.name, props.multi_processor_count)


def configs_for(x: torch.Tensor, lora_a: torch.Tensor, meta: SegmentMeta, slices: tuple[int, ...],
                table: TilingTable | None = None) -> tuple[TileConfig, TileConfig]:
    """The (shrink, expand) tilings for this batch and layer."""
    table = table or default_table(x.device.index or 0)
    n_slices, _, rank, k = lora_a.shape
    n = sum(slices)
    common = (meta.num_tokens, max(1, meta.max_seg_len))
    return (table.lookup(shape_key("shrink", *common, k, n, rank, n_slices)),
            table.lookup(shape_key("expand", *common, k, n, rank, n_slices)))


def one_launch_for(x: torch.Tensor, lora_a: torch.Tensor, meta: SegmentMeta, slices: tuple[int, ...],
                   table: TilingTable | None = None) -> tuple[str, TileConfig] | None:
    """(op, tiling) of the one-launch kernel that should serve this batch and layer ("fused" or
    "handoff"), else None: only where the table measured it faster than the two launches.

    Never for a mixture batch: the table's one-launch timings are of plain batches, and neither
    kernel takes the mixture's extra segment, so those stay on two launches.
    """
    if meta.mix_slot is not None or lora_a.shape[2] > FUSED_MAX_RANK or meta.num_segments == 0 or \
            meta.num_tokens > HANDOFF_MAX_TOKENS:
        return None
    table = table or default_table(x.device.index or 0)
    n_slices, _, rank, k = lora_a.shape
    return table.one_launch(shape_key("fused", meta.num_tokens, max(1, meta.max_seg_len), k, sum(slices), rank,
                                      n_slices))


def add_lora(y, x, lora_a, lora_b, meta: SegmentMeta, ranks, scales, slices, table: TilingTable | None = None,
             shrink_config: TileConfig | None = None, expand_config: TileConfig | None = None,
             fused_config: TileConfig | None = None, pdl: bool | None = None,
             flat: bool | tuple[bool, bool] | None = None, handoff_config: TileConfig | None = None):
    """y[:, slice i] += scales[s] * (x @ A[i, s].T) @ B[s, slice i].T for each token's slot s.

    Given configs pin the kernels: `fused_config` or `handoff_config` a one-launch kernel,
    `shrink_config` / `expand_config` the two launches; without any, the table chooses
    (`one_launch_for`).
    pdl: the expand launched behind the shrink with programmatic dependent launch, so that its
    launch overlaps the shrink (None: wherever the device supports it, `pdl_available`).
    flat: the token tiles' layout on both grids (`token_tiles.seg_block`; None: per launch, the
    one with fewer programs), or a (shrink, expand) pair of them.
    """
    slices = tuple(int(w) for w in slices)
    if len(slices) != lora_a.shape[0]:
        raise ValueError(f"slices {slices} name {len(slices)} output slices but lora_a has {lora_a.shape[0]}")
    pinned_ops = [name for name, c in (("fused_config", fused_config), ("handoff_config", handoff_config),
                                       ("shrink_config / expand_config", shrink_config or expand_config)) if c]
    if len(pinned_ops) > 1:
        raise ValueError(f"give add_lora one of fused_config, handoff_config or shrink_config / expand_config, "
                         f"got {' and '.join(pinned_ops)}")
    if not pinned_ops:
        op, config = one_launch_for(x, lora_a, meta, slices, table) or (None, None)
        fused_config, handoff_config = (config, None) if op == "fused" else (None, config)
    if fused_config is not None:
        return fused_add_lora(y, x, lora_a, lora_b, meta, ranks, scales, slices, fused_config)
    if handoff_config is not None:
        return handoff_add_lora(y, x, lora_a, lora_b, meta, ranks, scales, slices, handoff_config)
    if shrink_config is None or expand_config is None:
        looked_up = configs_for(x, lora_a, meta, slices, table)
        shrink_config, expand_config = shrink_config or looked_up[0], expand_config or looked_up[1]
    pdl = pdl_available(x.device) if pdl is None else pdl and pdl_available(x.device)
    shrink_flat, expand_flat = flat if isinstance(flat, tuple) else (flat, flat)
    v = shrink(x, lora_a, meta, ranks, shrink_config, launch_dependents=pdl, flat=shrink_flat)  # allocates v: no kernel
    return expand(y, v, lora_b, meta, ranks, scales, slices, expand_config, pdl=pdl, flat=expand_flat)  # between them


def pinned(shrink_config: TileConfig, expand_config: TileConfig, pdl: bool | None = None, flat: bool | None = None):
    """The ATMM op pinned to one static tiling for every shape (the fixed-tiling baseline)."""

    def add_lora_static(y, x, lora_a, lora_b, meta, ranks, scales, slices):
        return add_lora(y, x, lora_a, lora_b, meta, ranks, scales, slices,
                        shrink_config=shrink_config, expand_config=expand_config, pdl=pdl, flat=flat)

    return add_lora_static


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def add_lora_beside(base: Callable[[torch.Tensor], torch.Tensor], x, lora_a, lora_b, meta: SegmentMeta, ranks, scales,
                    slices, table: TilingTable | None = None):
    """base(x) with LoRA(x) added: what `add_lora(base(x), x, ...)` returns, but on a GPU the shrink
    runs on a side stream while `base` (the projection's own matmul) runs.

    The shrink needs only x, so it leaves the chain of dependent kernels: there a LoRA'd
    projection is base, shrink, expand one after another; here it is base, expand, with the
    shrink beside base. The expand needs both, so it waits for the two. It is launched without
    programmatic dependent launch: the kernel before it is base's, which writes y.
    On CPU, for a batch the table sends to a one-launch kernel, or an empty one: `add_lora` after `base`.
    """
    slices = tuple(int(w) for w in slices)
    if x.device.type != "cuda" or meta.num_segments == 0 or meta.max_seg_len == 0 or \
            one_launch_for(x, lora_a, meta, slices, table) is not None:
        return add_lora(base(x), x, lora_a, lora_b, meta, ranks, scales, slices, table)
    shrink_config, expand_config = configs_for(x, lora_a, meta, slices, table)
    # allocated on the main stream, where it is also freed (after the join below), so the
    # allocator never hands it out while the side stream may still write it
    v = torch.empty(v_shape(x, lora_a, meta, shrink_config), dtype=torch.float32, device=x.device)
    main = torch.cuda.current_stream(x.device)
    side = _SIDE_STREAMS.setdefault(x.device.index or 0, torch.cuda.Stream(x.device))
    side.wait_stream(main)  # x and the batch's metadata are written
    with torch.cuda.stream(side):
        shrink(x, lora_a, meta, ranks, shrink_config, out=v)
    try:
        y = base(x)
    finally:  # joined even if base raises: v must not be handed out again while the side stream writes it
        main.wait_stream(side)
    return expand(y, v, lora_b, meta, ranks, scales, slices, expand_config)
