"""PEFT LoRA directories -> host tensors in the pool's slot layout.

A PEFT directory stores one (lora_A, lora_B) pair per adapted module under keys such as

    base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_A.weight   A: [r, in]
    base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_B.weight   B: [out, r]

(older checkpoints put `language_model.model.` or a bare `model.` in front of `layers`). The
serving model fuses q/k/v and gate/up into one projection with column slices (serve.models
layers.py), so each PEFT module becomes one slice of a projection kind:

    lora_a[kind]: [L, n_slices, r_pad, in]    lora_b[kind]: [L, sum(slices), r_pad]
    ranks[kind]:  int32 [L, n_slices]  (0 = that layer's slice is not adapted)

r_pad is the adapter's largest rank on that kind rounded up to 16; rows of A / columns of B
past a module's rank are zero (the kernels' contract). PEFT scales each module by
alpha / r (alpha / sqrt(r) with rsLoRA; `rank_pattern` / `alpha_pattern` per module); the pool
keeps one scale per kind and slot, so a module whose scale differs from its kind's first one
gets the ratio folded into its B (exact in fp32; the usual uniform config folds nothing).

The vision tower's projections (`train_vision_tower`) are kinds `tower.*` of their own, one layer
per tower block (serve/lora/tower_shapes.py says which keys land where), read alike when the
server is given the tower's layout. Anything the serving model cannot apply exactly (LoRA on the
embeddings, the merger or projector, DoRA, LoRA biases, modules_to_save, a shape that does not fit
the model) is refused with an `AdapterLoadError` that names the directory and what is wrong.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adapters.meta import read_meta
from adapters.layout import PEFT_CONFIG as CONFIG_FILE
from adapters.layout import PEFT_WEIGHTS as WEIGHTS_FILE
from adapters.peft import AdapterLoadError, fail, read_config, read_tensors  # noqa: F401 (AdapterLoadError: this module's API)

_KEY = re.compile(r"^(?P<prefix>.*?)layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<module>\w+)"
                  r"\.lora_(?P<ab>[AB])\.weight$")
_VISION_MARKERS = ("visual", "vision", "multi_modal_projector", "merger", "mm_projector")


@dataclass(frozen=True)
class ProjectionShape:
    """One projection kind of the serving model (e.g. qkv_proj with slices q_proj, k_proj, v_proj)."""

    kind: str
    in_features: int
    slices: tuple[int, ...]  # output width of each slice
    slice_names: tuple[str, ...]  # the PEFT module name of each slice
    # tensor parallel (serve.models.parallel): ("out" | "in", rank, world) = the rank holds its chunk of
    # every slice's output columns, or of the input; the adapter's B rows or A columns are cut alike
    shard: tuple[str, int, int] | None = None

    @property
    def out_features(self) -> int:
        return sum(self.slices)


def model_shapes(language_model) -> tuple[int, dict[str, ProjectionShape]]:
    """(num_layers, kind -> ProjectionShape) of a serve.models DecoderModel."""
    shapes: dict[str, ProjectionShape] = {}
    layers = set()
    for layer, kind, module in language_model.projections():
        layers.add(layer)
        shard = getattr(getattr(module, "base", module), "tp_shard", None)
        shapes.setdefault(kind, ProjectionShape(kind, module.in_features, module.output_slices, module.slice_names,
                                                shard))
    return len(layers), shapes


def cut_to_shard(a: torch.Tensor, b: torch.Tensor, shard: tuple[str, int, int] | None):
    """One PEFT module's (A [r, in], B [out, r]) cut to a projection shard (Punica's split: no
    communication of its own): "out" keeps B's rows of the rank, "in" A's columns; None: whole.
    A width that does not split evenly is left whole, so the shape check names the mismatch."""
    if shard is None:
        return a, b
    axis, rank, world = shard
    n = b.shape[0] if axis == "out" else a.shape[-1]
    if n % world:
        return a, b
    step = n // world
    if axis == "out":
        return a, b[rank * step:(rank + 1) * step]
    return a[:, rank * step:(rank + 1) * step], b


@dataclass
class AdapterWeights:
    """LoRA tensors of one adapter in the pool's slot layout (host memory; only adapted kinds)."""

    lora_a: dict[str, torch.Tensor]  # kind -> [L, n_slices, r_pad, in]
    lora_b: dict[str, torch.Tensor]  # kind -> [L, out, r_pad]
    ranks: dict[str, torch.Tensor]  # kind -> int32 [L, n_slices]
    scales: dict[str, float]  # kind -> the scale B @ A is multiplied by

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.lora_a, self.lora_b) for t in d.values())

    def pinned(self) -> "AdapterWeights":
        """A copy in page-locked memory, so copies to the GPU run asynchronously at full bandwidth."""
        def pin(d):
            return {k: t.pin_memory() for k, t in d.items()}

        return AdapterWeights(pin(self.lora_a), pin(self.lora_b), pin(self.ranks), dict(self.scales))


@dataclass
class AdapterSpec:
    """What an adapter directory holds, beside its weights (reported by `list_adapters`)."""

    path: str
    rank: int  # largest rank of any module
    module_ranks: dict[str, int]  # PEFT module name -> its largest rank over layers
    targets: tuple[str, ...]  # adapted module names, in model order
    layers: int  # layers with at least one adapted module
    nbytes: int
    scales_folded: bool = False  # some module's scale was folded into its B (see module docstring)
    meta: dict = field(default_factory=dict)  # meta.json when present


def _pattern_value(patterns: dict, module_key: str, default):
    """PEFT's `get_pattern_key`: the first pattern matching the end of the module name."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            return value
    return default


def _scale(config: dict, module_key: str, rank: int, path: Path) -> float:
    r = _pattern_value(config.get("rank_pattern"), module_key, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern"), module_key, config["lora_alpha"])
    if int(r) != rank:
        raise fail(path, f"{module_key} has rank {rank} in {WEIGHTS_FILE} but {int(r)} in {CONFIG_FILE}")
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def read_adapter(path: str | Path, num_layers: int, shapes: dict[str, ProjectionShape], max_rank: int,
                 dtype: torch.dtype, tower=None) -> tuple[AdapterWeights, AdapterSpec]:
    """Reads and checks a PEFT directory against the serving model's projections.

    shapes: the projection kinds the pool holds (kinds left out cannot be adapted);
    max_rank: the pool's rank; dtype: the pool's dtype; tower: the vision tower's
    `tower_shapes.TowerLayout` when the pool holds its kinds (None: tower tensors are refused).
    """
    path = Path(path)
    config = read_config(path)
    tensors = read_tensors(path)
    layers_of = {kind: num_layers for kind in shapes} | (dict(tower.layers) if tower is not None else {})
    slot_of = {name: (kind, i) for kind, s in shapes.items() for i, name in enumerate(s.slice_names)}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # (layer, module) -> {"A": .., "B": ..}
    keys: dict[tuple[int, str], str] = {}
    unserved = []
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        module_key = re.sub(r"^base_model\.model\.", "", key).rsplit(".lora_", 1)[0]
        located = None if tower is None or not key.endswith(("lora_A.weight", "lora_B.weight")) \
            else tower.locate(module_key)
        if located is not None:  # a tower projection: its kind is its one slice's name
            layer, module, ab = located[1], located[0], key[-len("A.weight")]
            if layer < 0:  # a CLIP layer past LLaVA's feature layer: never run, nothing to apply
                continue
            tensor = tensor.flatten(1) if tensor.dim() > 2 else tensor  # the patch embedding's conv kernels
        elif m is None or any(marker in m["prefix"] for marker in _VISION_MARKERS) or m["module"] not in slot_of:
            unserved.append(key)
            continue
        else:
            layer, module, ab = int(m["layer"]), m["module"], m["ab"]
        pairs.setdefault((layer, module), {})[ab] = tensor
        keys[(layer, module)] = module_key
    if unserved:
        tower_part = (f" and the vision tower's {sorted(k.removeprefix('tower.') for k in tower.shapes)}"
                      if tower is not None else " (no vision tower: this model's tower takes no LoRA)")
        raise fail(path, f"{len(unserved)} tensor(s) adapt modules the server does not apply LoRA to, e.g. "
                          f"{unserved[:3]}; served: the language model's "
                          f"{sorted(n for n in slot_of if not n.startswith('tower.'))}{tower_part} "
                          "(no embeddings, merger, projector or LM head)")
    if not pairs:
        raise fail(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    ranks_host = {kind: torch.zeros(layers_of[kind], len(s.slices), dtype=torch.int32) for kind, s in shapes.items()}
    checked = {}
    for (layer, module), ab in sorted(pairs.items()):
        kind, i = slot_of[module]
        shape = shapes[kind]
        where = keys[(layer, module)]
        if set(ab) != {"A", "B"}:
            raise fail(path, f"{where} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        if layer >= layers_of[kind]:
            raise fail(path, f"{where}: layer {layer} does not exist (the model has {layers_of[kind]} layers)")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise fail(path, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not [r, in], [out, r]")
        a, b = cut_to_shard(a, b, shape.shard)
        rank, width = a.shape[0], shape.slices[i]
        if a.shape[1] != shape.in_features or b.shape[0] != width:
            raise fail(path, f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit this model's "
                              f"{module} ([r, {shape.in_features}] / [{width}, r]): an adapter of another base model?")
        if not 0 < rank <= max_rank:
            raise fail(path, f"{where}: rank {rank} exceeds the server's max_lora_rank {max_rank}")
        if not (a.is_floating_point() and torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise fail(path, f"{where}: weights are not finite floats (a corrupt file?)")
        ranks_host[kind][layer, i] = rank
        checked[(layer, module)] = (kind, i, a, b, _scale(config, where, rank, path))
    weights, folded = _pack(checked, ranks_host, shapes, layers_of, dtype)
    module_ranks: dict[str, int] = {}
    for (_, module), (_, _, a, _, _) in checked.items():
        module_ranks[module] = max(module_ranks.get(module, 0), a.shape[0])
    order = [n for s in shapes.values() for n in s.slice_names]
    targets = tuple(n for n in order if n in module_ranks)
    try:
        meta = read_meta(path, required=False)
    except ValueError as e:
        raise fail(path, str(e)) from e
    spec = AdapterSpec(str(path), max(module_ranks.values()), {n: module_ranks[n] for n in targets}, targets,
                       len({layer for layer, module in checked if not module.startswith("tower.")}), weights.nbytes,
                       scales_folded=folded, meta=meta)
    return weights, spec


def _pack(checked: dict, ranks_host: dict, shapes: dict[str, ProjectionShape], layers_of: dict[str, int],
          dtype: torch.dtype) -> tuple[AdapterWeights, bool]:
    lora_a, lora_b, ranks, scales = {}, {}, {}, {}
    folded = False
    for kind, shape in shapes.items():
        mine = {key: v for key, v in checked.items() if v[0] == kind}
        if not mine:
            continue
        r_pad = -(-int(ranks_host[kind].max()) // 16) * 16
        a_out = torch.zeros(layers_of[kind], len(shape.slices), r_pad, shape.in_features, dtype=dtype)
        b_out = torch.zeros(layers_of[kind], shape.out_features, r_pad, dtype=dtype)
        base_scale = None
        for (layer, _), (_, i, a, b, scale) in sorted(mine.items()):
            rank = a.shape[0]
            lo = sum(shape.slices[:i])
            base_scale = scale if base_scale is None else base_scale
            ratio = scale / base_scale
            folded |= ratio != 1.0
            a_out[layer, i, :rank] = a
            b_out[layer, lo:lo + shape.slices[i], :rank] = b.double().mul(ratio) if ratio != 1.0 else b
        lora_a[kind], lora_b[kind] = a_out, b_out
        ranks[kind], scales[kind] = ranks_host[kind].clone(), float(base_scale)
    return AdapterWeights(lora_a, lora_b, ranks, scales), folded
