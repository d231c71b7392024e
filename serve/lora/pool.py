"""The unified adapter pool: fixed device slots in the kernels' stacked layout, and a host cache.

Device side, one set per projection kind (qkv_proj, o_proj, gate_up_proj, down_proj), allocated
once at start and never reallocated, so layer views and captured CUDA graphs stay valid:

    lora_a[kind]: [L, n_slices, S, R, in]     lora_b[kind]: [L, S, out, R]
    ranks[kind]:  int32 [L, n_slices, S]      scales[kind]: float32 [S]

(L: the language model's layers; a vision tower's kinds, `tower.*` (serve/lora/tower.py), have
their own L, one per tower block, and share the slots: a slot holds both halves of its adapter.)

Layer l's views `lora_a[kind][l]` ([n_slices, S, R, in]), `lora_b[kind][l]` ([S, out, R]),
`ranks[kind][l]` and `scales[kind]` are exactly what `vlora_kernels.add_lora` takes; the stacked
tensors are what `vlora_kernels.merge_lora_` takes (with ranks reduced over layers), so the
merged and mixture modes fold a slot in place without copies. Loading an adapter into slot s
is a copy of its host tensors into [:, :, s, :r_pad] (rows past r_pad zeroed): one
host-to-device transfer of its real bytes, however large R is.

Host side, `HostCache` keeps the packed weights of recently used adapters (page-locked when
a GPU is used, so swaps are asynchronous DMA), least recently used evicted beyond its capacity.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .loader import AdapterWeights, ProjectionShape

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class PoolConfig:
    slots: int = 8  # adapters resident on the device at once
    host_cache: int = 64  # adapters whose weights stay in host memory
    max_rank: int = 64  # largest adapter rank served (the pool's R, rounded up to 16)
    targets: tuple[str, ...] = ALL_TARGETS  # modules adapters may adapt; other kinds get no pool
    backend: str = "auto"  # "triton" (ATMM kernels), "torch" (plain PyTorch), "auto": triton on GPU in fp16/bf16
    overlap_shrink: bool = False  # triton on a GPU: the shrink beside the base matmul (vlora_kernels.add_lora_beside)
    tower: bool = True  # slots for the vision tower's projections too (serve/lora/tower.py)

    def __post_init__(self) -> None:
        if self.slots < 1 or self.host_cache < 0 or self.max_rank < 1:
            raise ValueError(f"adapter slots ({self.slots}) and max_lora_rank ({self.max_rank}) must be >= 1 "
                             f"and host_adapter_cache ({self.host_cache}) >= 0")
        unknown = sorted(set(self.targets) - set(ALL_TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"lora_targets {list(self.targets)}: must be a non-empty subset of {list(ALL_TARGETS)}")
        if self.backend not in ("auto", "triton", "torch"):
            raise ValueError(f"lora_backend {self.backend!r} is not one of auto, triton, torch")


class AdapterPool:
    def __init__(self, num_layers: int, shapes: dict[str, ProjectionShape], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, layers: dict[str, int] | None = None):
        """layers: kind -> its layer count where it is not `num_layers` (the vision tower's kinds)."""
        self.num_layers, self.num_slots, self.dtype, self.device = num_layers, num_slots, dtype, device
        self.rank = -(-max_rank // 16) * 16  # the kernels need a multiple of 16
        self.shapes = dict(shapes)
        self.layers = {kind: (layers or {}).get(kind, num_layers) for kind in self.shapes}
        self.lora_a: dict[str, torch.Tensor] = {}
        self.lora_b: dict[str, torch.Tensor] = {}
        self.ranks: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}
        for kind, s in self.shapes.items():
            n, num_layers = len(s.slices), self.layers[kind]
            self.lora_a[kind] = torch.zeros(num_layers, n, num_slots, self.rank, s.in_features, dtype=dtype,
                                            device=device)
            self.lora_b[kind] = torch.zeros(num_layers, num_slots, s.out_features, self.rank, dtype=dtype,
                                            device=device)
            self.ranks[kind] = torch.zeros(num_layers, n, num_slots, dtype=torch.int32, device=device)
            self.scales[kind] = torch.zeros(num_slots, dtype=torch.float32, device=device)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.shapes)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.lora_a, self.lora_b) for t in d.values())

    def layer_views(self, kind: str, layer: int):
        """(lora_a [n_slices, S, R, in], lora_b [S, out, R], ranks int32 [n_slices, S], scales [S]) of one layer."""
        return self.lora_a[kind][layer], self.lora_b[kind][layer], self.ranks[kind][layer], self.scales[kind]

    def write(self, slot: int, weights: AdapterWeights) -> None:
        """Copies an adapter into `slot` on the current stream (asynchronous from pinned memory)."""
        for kind in self.shapes:
            a_slot, b_slot = self.lora_a[kind][:, :, slot], self.lora_b[kind][:, slot]  # [L, n, R, in], [L, out, R]
            if kind not in weights.lora_a:
                a_slot.zero_()
                b_slot.zero_()
                self.ranks[kind][:, :, slot].zero_()
                self.scales[kind][slot] = 0.0
                continue
            a, b = weights.lora_a[kind], weights.lora_b[kind]
            r = a.shape[2]
            if r > self.rank:
                raise ValueError(f"adapter rank {r} exceeds the pool's rank {self.rank}")
            a_slot[:, :, :r].copy_(a, non_blocking=True)
            a_slot[:, :, r:].zero_()
            b_slot[:, :, :r].copy_(b, non_blocking=True)
            b_slot[:, :, r:].zero_()
            self.ranks[kind][:, :, slot].copy_(weights.ranks[kind], non_blocking=True)
            self.scales[kind][slot] = weights.scales[kind]

    def clear(self, slot: int) -> None:
        """Marks a slot empty: rank 0 everywhere (its stale weights are never read at rank 0)."""
        for kind in self.shapes:
            self.ranks[kind][:, :, slot].zero_()
            self.scales[kind][slot] = 0.0

    def merge_ranks(self, kind: str) -> torch.Tensor:
        """int32 [n_slices, S]: ranks over all layers, the `ranks` argument of `vlora_kernels.merge_lora_`
        (zero rows past a layer's own rank add nothing)."""
        return self.ranks[kind].amax(dim=0)


class HostCache:
    """name -> AdapterWeights in host memory, least recently used first out beyond `capacity`."""

    def __init__(self, capacity: int, pin: bool):
        self.capacity, self.pin = capacity, pin
        self._items: OrderedDict[str, AdapterWeights] = OrderedDict()
        self.evictions = 0

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def names(self) -> list[str]:
        """Least recently used first."""
        return list(self._items)

    def get(self, name: str) -> AdapterWeights | None:
        weights = self._items.get(name)
        if weights is not None:
            self._items.move_to_end(name)
        return weights

    def put(self, name: str, weights: AdapterWeights) -> AdapterWeights:
        """Stores (pinned when asked) and returns the stored copy; evicts beyond capacity."""
        stored = weights.pinned() if self.pin else weights
        if self.capacity == 0:
            return stored
        self._items[name] = stored
        self._items.move_to_end(name)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
            self.evictions += 1
        return stored

    def drop(self, name: str) -> None:
        self._items.pop(name, None)
