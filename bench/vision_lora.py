"""What LoRA on the vision tower costs (`bench.vision.tower_lora=true`): our tower's pass with and without
rank-r adapters on every projection it serves (serve/lora/tower.py), as the engine runs them.

Per batch of chunks (the same packed pass as the rest of the vision suite), medians of:
- `tower_ms_per_chunk_no_lora`: the pass with the hooks installed and no item adapted (what every
  step pays once an engine serves tower adapters: the hooks' checks only);
- `tower_lora_ms_per_chunk`: every item under one adapter (one segment per projection);
- `tower_lora_mixed_ms_per_chunk`: items spread round-robin over `adapters` adapters in one pass;
- `tower_lora_overhead` / `tower_lora_mixed_overhead`: those over the no-LoRA pass.
The op is the engine's (`resolve_backend("auto")`: ATMM on a GPU in bf16/fp16, PyTorch otherwise),
the adapters random (A and B drawn, every slice at the full rank).
"""

from __future__ import annotations

import torch

from serve.lora import AdapterPool, AdapterWeights, resolve_backend
from serve.lora.tower import TowerLoRA
from serve.lora.tower_shapes import tower_layout


def random_tower_adapters(tower, count: int, rank: int, dtype, device, seed: int = 0) -> AdapterPool:
    """A pool of `count` slots over the tower's projections, each slot a random rank-`rank` adapter."""
    layout = tower_layout(tower)
    pool = AdapterPool(1, layout.shapes, count, rank, dtype, device, layers=layout.layers)
    g = torch.Generator().manual_seed(seed)
    for slot in range(count):
        a, b, ranks, scales = {}, {}, {}, {}
        for kind, shape in layout.shapes.items():
            n = layout.layers[kind]
            a[kind] = (torch.randn(n, 1, pool.rank, shape.in_features, generator=g) / shape.in_features ** 0.5).to(dtype)
            b[kind] = (torch.randn(n, shape.out_features, pool.rank, generator=g) * 0.02).to(dtype)
            ranks[kind] = torch.full((n, 1), rank, dtype=torch.int32)
            scales[kind] = 2.0
        pool.write(slot, AdapterWeights(a, b, ranks, scales))
    return pool


def time_tower_lora(ours, pixels: torch.Tensor, grids, rank: int, adapters: int, time_ms) -> dict:
    """The columns above for one packed pass (`time_ms(fn)` -> median ms of the whole pass)."""
    weight = ours.patch_embed.proj.weight
    pool = random_tower_adapters(ours, adapters, rank, weight.dtype, weight.device)
    lora = TowerLoRA(None, ours, pool, resolve_backend("auto", weight.device, weight.dtype))
    rows = [t * h * w for t, h, w in grids]
    out = {}
    try:
        for column, slots in (("tower_ms_per_chunk_no_lora", [-1] * len(grids)),
                              ("tower_lora_ms_per_chunk", [0] * len(grids)),
                              ("tower_lora_mixed_ms_per_chunk", [i % adapters for i in range(len(grids))])):
            lora.bind(slots, rows)  # the segments are built per pass, as in serving
            out[column] = time_ms(lambda: (lora.bind(slots, rows), ours(pixels, ours.layout(grids))))
    finally:
        lora.unbind()
        lora.remove()
    out["tower_lora_overhead"] = out["tower_lora_ms_per_chunk"] / out["tower_ms_per_chunk_no_lora"]
    out["tower_lora_mixed_overhead"] = out["tower_lora_mixed_ms_per_chunk"] / out["tower_ms_per_chunk_no_lora"]
    return out
