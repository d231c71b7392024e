"""The adapter manager (vLLM's LoRA-manager tier): registry, slots, host cache, swaps, pinning.

    manager = AdapterManager(model, PoolConfig(slots=8, host_cache=64, max_rank=64), dtype, device)
    manager.load("signs", "adapters/signs")        # read + checked + heads, or AdapterLoadError
    manager.ready("signs") -> bool                 # resident? else start its swap into a slot
    manager.acquire("signs") / release("signs")    # a running sequence holds its adapter's slot
    batch = manager.step_batch([(adapter, n_tokens), ...])   # the step's LoraBatch (or None)

Loading reads and checks everything (weights, heads, meta) before registering anything, so a
bad directory leaves the served set as it was. An adapter whose meta.json records a base model
other than the engine's (`base`, adapters.base) is refused unless allow_base_mismatch=True. Registered adapters keep their weights in the
host cache (re-read from disk if evicted from it); `ready` puts an adapter into a free slot, or
the least recently used slot that no running sequence holds and no pin protects. On a GPU the
copy runs on a side stream (ordered after the work already queued) and `ready` turns true once
its event has completed, so the scheduler keeps serving other requests while the swap lands.
The scheduler sees only `ready`, `acquire` and `release` (serve.engine.scheduler.AdapterGate).

The pool also holds the vision tower's projections (serve/lora/tower.py, unless PoolConfig.tower
is off): an adapter trained with `train_vision_tower` takes one slot for both halves, and
`tower.step(slots_by_key)` applies its tower part to its requests' items in the step's encoder pass.

Modes (serve/lora/modes.py): `set_merged(name)` folds a resident adapter into the base weights
(holding a reference on it, so its slot is neither evicted nor unloaded while merged) and
`set_merged(None)` folds it out again; while one is merged, `step_batch` builds mixture metadata.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adapters.base import BaseMismatch, check_base, recorded_base

from .heads import head_tasks, load_adapter_heads, select_head
from .layers import wrap_projections
from .loader import AdapterLoadError, AdapterSpec, AdapterWeights, model_shapes, read_adapter
from .metadata import LoraBatch, LoraGraphBuffers, build_lora_batch, resolve_backend
from .modes import MixtureGraphBuffers, WeightMerger, build_mixture_batch
from .pool import AdapterPool, HostCache, PoolConfig
from .tower import TowerLoRA
from .tower_shapes import PREFIX as TOWER
from .tower_shapes import tower_layout, tower_of


@dataclass
class AdapterRecord:
    name: str
    spec: AdapterSpec
    heads: dict[str, Any]  # domain -> heads.TaskHead
    version: int  # distinguishes a reload under the same name (part of the prefix-cache key)
    pinned: bool = False
    refs: int = 0  # running sequences using it: its slot cannot be taken while > 0
    slot: int | None = None
    event: Any = None  # CUDA event of an in-flight swap into `slot`
    last_use: int = 0
    swaps: int = 0

    def info(self, in_host_cache: bool, merged: bool = False) -> dict:
        """JSON-ready description (what `Engine.list_adapters` returns). merged: it is folded into the
        base weights, which holds one reference of its own: `running` counts sequences only."""
        s = self.spec
        tasks = s.meta.get("tasks")
        return {"name": self.name, "path": s.path, "rank": s.rank, "ranks": dict(s.module_ranks),
                "targets": list(s.targets), "layers": s.layers, "bytes": s.nbytes,
                "heads": head_tasks(self.heads, s.meta), "tasks": list(tasks) if isinstance(tasks, list) else [],
                "pinned": self.pinned,
                "resident": self.slot is not None and (self.event is None or self.event.query()),
                "slot": self.slot, "in_host_cache": in_host_cache, "running": self.refs - merged, "merged": merged,
                "swaps": self.swaps, "version": self.version}


class AdapterManager:
    def __init__(self, model, config: PoolConfig, dtype: torch.dtype, device: torch.device,
                 base: dict | None = None):
        self.config, self.dtype, self.device = config, dtype, device
        self.base = base  # the engine's base identity (adapters.base); None: adapters are not checked
        lm = model.language_model
        self.hidden_size = model.args.hidden_size
        self.num_layers, shapes = model_shapes(lm)
        shapes = {k: s for k, s in shapes.items() if set(s.slice_names) & set(config.targets)}
        self.targets = tuple(config.targets)
        self.backend = self.configured_backend = resolve_backend(config.backend, device, dtype)
        tower = tower_of(model) if config.tower else None
        self.tower_layout = tower_layout(tower) if tower is not None else None  # None: tower LoRA is refused
        if self.tower_layout is not None:
            shapes |= self.tower_layout.shapes
        self.pool = AdapterPool(self.num_layers, shapes, config.slots, config.max_rank, dtype, device,
                                layers=self.tower_layout.layers if self.tower_layout is not None else None)
        self.layers = wrap_projections(lm, self.pool, overlap_shrink=config.overlap_shrink)
        self.tower = None if tower is None else TowerLoRA(getattr(model.vision, "inner", model.vision), tower,
                                                          self.pool, self.configured_backend)
        self.host = HostCache(config.host_cache, pin=device.type == "cuda")
        self.records: dict[str, AdapterRecord] = {}
        self.slots: list[str | None] = [None] * config.slots
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._clock = itertools.count(1)
        self._versions = itertools.count(1)
        self.counters = {"swaps": 0, "slot_evictions": 0, "host_reads": 0, "swap_bytes": 0}
        self.merger: WeightMerger | None = None  # built by enable_modes(): restacks the projection weights
        self.switch_method: str | None = None  # a policy's per-layer switches ("addmm"); None: the merger's own
        self.sync_swaps = False  # True: ready() waits for a swap-in instead of deferring its requests
        self.merged: str | None = None  # the adapter folded into the base weights (merge / mixture mode)
        self.switch_times_ms: list[float] = []  # one entry per fold in or out

    # ---- modes (merge / mixture) --------------------------------------------------------------
    def enable_modes(self, method: str = "auto") -> None:
        """Restacks the projection weights so adapters can be merged in place (once, at start)."""
        if self.merger is None:
            self.merger = WeightMerger(self.layers, self.pool, self.device, method)

    def set_merged(self, name: str | None) -> float:
        """Brings the base weights to hold adapter `name` (None: none); returns the switch time in ms.
        The new adapter is made resident first (waiting for its swap); if it cannot get a slot the
        weights end up holding nothing and ValueError says why (unmerge runs every request)."""
        if self.merger is None:
            raise RuntimeError("modes are not enabled: call enable_modes() at start (before CUDA graphs)")
        if name == self.merged:
            return 0.0
        total = 0.0
        if self.merged is not None:
            total += self._fold(self.merged, -1)
            self.release(self.merged)
            self.merged = None
        if name is not None:
            if not self.ready(name):
                self.wait_pending()
                if not self.ready(name):
                    raise ValueError(f"adapter {name!r} cannot be merged: no free adapter slot")
            self.acquire(name)
            total += self._fold(name, +1)
            self.merged = name
        return total

    def _fold(self, name: str, sign: int) -> float:
        ms = self.merger.fold(self.get(name).slot, sign, self.switch_method)
        self.switch_times_ms.append(ms)
        return ms

    # ---- registry --------------------------------------------------------------------------
    def _read(self, path: str | Path):
        weights, spec = read_adapter(path, self.num_layers, self.pool.shapes, self.config.max_rank, self.dtype,
                                     self.tower_layout)
        outside = [m for m in spec.targets if m not in self.targets and not m.startswith(TOWER)]
        if outside:  # only reachable when lora_targets drops a slice of a fused kind the pool holds
            raise AdapterLoadError(f"adapter directory {str(path)!r} adapts {outside}, outside the server's "
                                   f"lora_targets {list(self.targets)}")
        self.counters["host_reads"] += 1
        return weights, spec

    def load(self, name: str, path: str | Path, pin: bool = False, allow_base_mismatch: bool = False) -> dict:
        if not isinstance(name, str) or not name or name == "__base__":
            raise ValueError(f"adapter name {name!r}: give a non-empty string other than '__base__'")
        if name in self.records:
            raise ValueError(f"adapter {name!r} is already loaded (from {self.records[name].spec.path}); "
                             "unload it first to replace it")
        if pin:
            self._check_pinnable(name)
        weights, spec = self._read(path)
        if not allow_base_mismatch:
            try:
                check_base(recorded_base(spec.meta), self.base, f"adapter {name!r} ({path})")
            except BaseMismatch as e:
                raise AdapterLoadError(str(e)) from None
        heads = load_adapter_heads(path, spec.meta, self.hidden_size, self.device)
        record = AdapterRecord(name, spec, heads, next(self._versions))
        self.records[name] = record  # everything checked: nothing above changed any state
        self.host.put(name, weights)
        if pin:
            self.pin(name)
        return record.info(name in self.host, name == self.merged)

    def load_made_up(self, name: str, rank: int = 16, seed: int = 0) -> dict:
        """Registers an adapter on every language-model projection the pool holds, with no directory behind
        it: the warm-up's, so that the merge kernels and mixture steps run before a server that starts with
        no adapter (tenants load theirs later) says it is ready. Its A is random and its B zero: every kernel
        runs as for a real adapter, and folding it in and out leaves the base weights as they were (W + 0).
        Unload it before serving; evicted from the host cache it could not be read again."""
        if name in self.records:
            raise ValueError(f"adapter {name!r} is already loaded")
        rank = min(rank, self.config.max_rank)
        gen = torch.Generator().manual_seed(seed)
        a, b, ranks, scales, targets = {}, {}, {}, {}, []
        for kind, shape in self.pool.shapes.items():
            if kind.startswith(TOWER):
                continue
            targets += [m for m in shape.slice_names if m in self.targets]
            n = len(shape.slices)
            a[kind] = (torch.randn(self.num_layers, n, rank, shape.in_features, generator=gen) * 0.01).to(self.dtype)
            b[kind] = torch.zeros(self.num_layers, shape.out_features, rank, dtype=self.dtype)
            adapted = torch.tensor([m in self.targets for m in shape.slice_names], dtype=torch.int32)
            ranks[kind] = (adapted * rank).expand(self.num_layers, n).contiguous()
            scales[kind] = 1.0
        weights = AdapterWeights(a, b, ranks, scales)
        spec = AdapterSpec("(made up)", rank, dict.fromkeys(targets, rank), tuple(targets), self.num_layers,
                           weights.nbytes)
        self.records[name] = AdapterRecord(name, spec, {}, next(self._versions))
        self.host.put(name, weights)
        return self.records[name].info(True)

    def get(self, name: str) -> AdapterRecord:
        record = self.records.get(name)
        if record is None:
            # the message names only what was asked for: over the server it reaches one client, and
            # the other adapters (other tenants') are none of its business (list_adapters shows them)
            raise ValueError(f"adapter {name!r} is not loaded; load it with Engine.load_adapter(name, path) "
                             "or send adapter=None for the base model")
        return record

    def unload(self, name: str) -> None:
        record = self.get(name)
        if name == self.merged:  # Engine.unload_adapter folds it out first, through its planner
            raise RuntimeError(f"adapter {name!r} is held by the base weights it is merged into; "
                               "fold it out first (set_merged(None))")
        if record.refs:
            raise RuntimeError(f"adapter {name!r} is held by {record.refs} running sequence(s)")
        if record.slot is not None:
            if record.event is not None:
                record.event.synchronize()  # the copy must land before the slot can be reused
            self.pool.clear(record.slot)
            self.slots[record.slot] = None
        self.host.drop(name)
        del self.records[name]

    def pin(self, name: str, pinned: bool = True) -> None:
        """A pinned adapter keeps its slot once resident (hot adapters never pay a swap)."""
        record = self.get(name)
        if pinned and not record.pinned:
            self._check_pinnable(name)
            record.pinned = True
            self.ready(name)  # start its swap now if it is not resident
        record.pinned = pinned

    def _check_pinnable(self, name: str) -> None:
        if sum(r.pinned for r in self.records.values()) + 1 >= self.config.slots:
            raise ValueError(f"cannot pin {name!r}: at least one of the {self.config.slots} adapter slots "
                             "must stay unpinned for the other adapters")

    def list(self) -> list[dict]:
        return [r.info(r.name in self.host, r.name == self.merged) for r in self.records.values()]

    def adapts_tower(self, name: str) -> bool:
        """Whether the adapter's LoRA reaches the vision tower (its items' tower outputs are its own)."""
        return any(m.startswith(TOWER) for m in self.get(name).spec.targets)

    def select_head(self, name: str, task: str | None):
        record = self.get(name)
        return select_head(name, record.heads, record.spec.meta, task)

    def load_manifest(self, path, pin: bool = False, allow_base_mismatch: bool = False) -> list[str]:
        """Loads every adapter of a fusion manifest, an adapter directory or a list of these
        (adapters.read_sources resolves their paths and refuses clashing names)."""
        from adapters.sources import kind_of, read_sources

        for source in [path] if isinstance(path, (str, Path)) else path:
            if kind_of(source) is None:
                raise AdapterLoadError(f"no fusion manifest or adapter directory at {source}")
        names = []
        for entry in read_sources(path).entries:
            if entry.name not in self.records:
                self.load(entry.name, entry.path, pin=pin, allow_base_mismatch=allow_base_mismatch)
            names.append(entry.name)
        return names

    # ---- slots (the scheduler's AdapterGate) ---------------------------------------------------
    def ready(self, name: str) -> bool:
        """True when the adapter is usable this step; otherwise starts its swap if a slot can be had."""
        record = self.get(name)
        record.last_use = next(self._clock)
        if record.slot is None:
            slot = self._take_slot()
            if slot is None:
                return False
            self._swap_in(record, slot)
        if record.event is not None:
            if self.sync_swaps:  # tensor parallel: every rank must see the swap land at the same step
                record.event.synchronize()
            elif not record.event.query():
                return False
            record.event = None
        return True

    def acquire(self, name: str) -> None:
        record = self.get(name)
        if record.slot is None or record.event is not None:
            raise RuntimeError(f"adapter {name!r} is acquired before its swap completed; call ready() first")
        record.refs += 1
        record.last_use = next(self._clock)

    def release(self, name: str) -> None:
        record = self.records.get(name)
        if record is not None:
            record.refs -= 1
            if record.refs < 0:
                raise RuntimeError(f"adapter {name!r} released more often than acquired")

    def wait_pending(self) -> bool:
        """Blocks until every in-flight swap has landed; True if there was one."""
        pending = [r for r in self.records.values() if r.event is not None]
        for r in pending:
            r.event.synchronize()
        return bool(pending)

    def _take_slot(self) -> int | None:
        if None in self.slots:
            return self.slots.index(None)
        victims = [r for r in self.records.values() if r.slot is not None and r.refs == 0 and not r.pinned
                   and (r.event is None or r.event.query())]
        if not victims:
            return None
        victim = min(victims, key=lambda r: r.last_use)
        slot, victim.slot, victim.event = victim.slot, None, None
        self.slots[slot] = None
        self.counters["slot_evictions"] += 1
        return slot

    def _swap_in(self, record: AdapterRecord, slot: int) -> None:
        weights = self.host.get(record.name)
        if weights is None:  # evicted from the host cache: read it again
            weights = self.host.put(record.name, self._read(record.spec.path)[0])
        record.slot = slot
        self.slots[slot] = record.name
        record.swaps += 1
        self.counters["swaps"] += 1
        self.counters["swap_bytes"] += weights.nbytes
        if self.stream is None:
            self.pool.write(slot, weights)
            return
        # after everything already queued (a previous step may still read the slot's old adapter)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.pool.write(slot, weights)
            record.event = torch.cuda.Event()
            record.event.record(self.stream)

    # ---- per-step metadata ------------------------------------------------------------------------
    def slot_of(self, name: str | None) -> int:
        if name is None:
            return -1
        record = self.get(name)
        if record.slot is None:
            raise RuntimeError(f"adapter {name!r} is scheduled but holds no slot")
        return record.slot

    def step_batch(self, entries: list[tuple[str | None, int]]) -> LoraBatch | None:
        """entries: (adapter, tokens this step) per sequence, in batch order."""
        slot_ids = []
        for adapter, n in entries:
            slot_ids.extend([self.slot_of(adapter)] * n)
        if self.merged is not None:  # mixture metadata (merge mode proper: None, no LoRA work)
            return build_mixture_batch(slot_ids, self.slot_of(self.merged), self.device, self.backend)
        return build_lora_batch(slot_ids, self.device, self.backend)

    def use_operator(self, op: str, switch_op: str = "atmm") -> None:
        """The operators a scheduling policy plans with: unmerged LoRA "atmm" (the configured backend:
        ATMM on GPU) or "einsum" (dLoRA's; eager), and switches "atmm" (the configured switch
        method: one-shot on GPU) or "addmm" (per layer, dLoRA's). Steps and switches after the call
        use them."""
        if op not in ("atmm", "einsum"):
            raise ValueError(f"LoRA operator {op!r} is not one of atmm, einsum")
        if switch_op not in ("atmm", "addmm"):
            raise ValueError(f"switch operator {switch_op!r} is not one of atmm, addmm")
        self.backend = self.configured_backend if op == "atmm" else "einsum"
        self.switch_method = None if switch_op == "atmm" else "addmm"  # None: the merger's own

    def graph_buffers(self, max_batch: int) -> LoraGraphBuffers | None:
        """Fixed metadata buffers for CUDA-graph decode, or None when the backend cannot be captured."""
        if self.configured_backend != "triton":
            return None
        return LoraGraphBuffers(max_batch, self.config.slots, self.device, self.configured_backend)

    def mixture_graph_buffers(self, max_batch: int) -> MixtureGraphBuffers | None:
        """Buffers of the mixture (deLoRA) graphs, or None when modes are off or cannot be captured."""
        if self.configured_backend != "triton" or self.merger is None:
            return None
        return MixtureGraphBuffers(max_batch, self.config.slots, self.device, self.configured_backend)

    def stats(self) -> dict[str, int]:
        return {"adapters_loaded": len(self.records), "adapters_resident": sum(s is not None for s in self.slots),
                "adapter_swaps": self.counters["swaps"], "adapter_slot_evictions": self.counters["slot_evictions"],
                "adapter_host_reads": self.counters["host_reads"], "adapters_in_host_cache": len(self.host)}
