"""Weights from Hugging Face checkpoints (safetensors, single file or sharded) into the serving model.

Checkpoints name the same tensors differently depending on who saved them: released
Qwen2-VL files use `model.layers.*` / `visual.*`, released LLaVA files
`language_model.model.layers.*` / `vision_tower.vision_model.*`, and transformers 5 in memory
`model.language_model.*` / `model.visual.*`. The loader finds the prefix that the checkpoint
actually uses, so every layout loads, and says which tensors are missing when one does not. A
tensor-parallel shard (a projection with `tp_shard`, parallel.py) reads only its rows or columns.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from .decoder import DecoderModel
from .parallel import part_range, shard_part

TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "language_model.")
LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


class WeightSource:
    """Named tensors of a checkpoint, read lazily: a directory of safetensors files or a mapping."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None = None, files: dict[str, Path] | None = None):
        self._tensors = tensors
        self._files = files or {}
        self._handles: dict[Path, object] = {}
        self.fp8 = None  # how FP8 projections are stored (fp8_checkpoint.Fp8Checkpoint), None: no FP8 tensors

    @classmethod
    def from_dir(cls, path: str | Path) -> "WeightSource":
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return cls(files={name: path / file for name, file in weight_map.items()})
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} holds no *.safetensors weights")
        from safetensors import safe_open

        mapping = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                mapping.update({name: file for name in f.keys()})
        return cls(files=mapping)

    def names(self) -> Iterable[str]:
        return self._tensors.keys() if self._tensors is not None else self._files.keys()

    def __contains__(self, name: str) -> bool:
        return name in (self._tensors if self._tensors is not None else self._files)

    def _handle(self, name: str):
        from safetensors import safe_open

        file = self._files[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt")
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor:
        if self._tensors is not None:
            return self._tensors[name]
        return self._handle(name).get_tensor(name)

    def get_part(self, name: str, shard: tuple[str, int, int]) -> torch.Tensor:
        """A tensor-parallel rank's part of tensor `name` (parallel.shard_part: "out" rows, "in" columns);
        from a file only those bytes are read."""
        if self._tensors is not None:
            return shard_part(self._tensors[name], shard)
        view = self._handle(name).get_slice(name)
        shape = view.get_shape()
        try:
            dim, start, length = part_range(shape, shard)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name}: {e}") from None
        index = [slice(None)] * len(shape)
        index[dim] = slice(start, start + length)
        return view[tuple(index)]

    def header(self, name: str) -> tuple[str, list[int]]:
        """(dtype, shape) of tensor `name` without reading its data: safetensors' dtype name ("BF16",
        "F8_E4M3") from a file's header, torch's ("torch.float8_e4m3fn") for an in-memory mapping
        (a mapping that makes its tensors on demand, random_weights.RandomWeights, says it unmade)."""
        if self._tensors is not None:
            if hasattr(self._tensors, "header"):
                return self._tensors.header(name)
            tensor = self._tensors[name]
            return str(tensor.dtype), list(tensor.shape)
        view = self._handle(name).get_slice(name)
        return view.get_dtype(), list(view.get_shape())


def is_fp8_dtype(dtype: str) -> bool:
    """Whether a header's dtype (WeightSource.header: safetensors' or torch's name) is FP8."""
    return dtype.startswith("F8") or dtype.startswith("torch.float8")


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, the model expects "
                         f"{tuple(param.shape)}")
    param.data.copy_(tensor)


def load_language_model(model: DecoderModel, source: WeightSource) -> None:
    prefix = next((p for p in TEXT_PREFIXES if p + "embed_tokens.weight" in source), None)
    if prefix is None:
        raise KeyError("no language-model embedding found: expected one of "
                       f"{[p + 'embed_tokens.weight' for p in TEXT_PREFIXES]}")

    def get(name: str) -> torch.Tensor:
        if prefix + name not in source:
            raise KeyError(f"checkpoint lacks {prefix + name}")
        return source.get(prefix + name)

    def maybe(name: str) -> torch.Tensor | None:
        return source.get(prefix + name) if prefix + name in source else None

    def load(linear: nn.Module, slice_name: str, module: str, bias: torch.Tensor | None = None) -> None:
        shard = getattr(linear, "tp_shard", None)  # a tensor-parallel shard (parallel.py) takes its part only
        key = prefix + module + ".weight"
        if shard is not None and key in source and not is_fp8_dtype(source.header(key)[0]):
            part = source.get_part(key, shard)
            linear.load_slice(slice_name, part, None if bias is None else shard_part(bias, shard))
            return
        weight = get(module + ".weight")
        if weight.dtype == torch.float8_e4m3fn:  # stored with its scales (checked before the model was built)
            from .fp8_checkpoint import load_fp8_slice

            load_fp8_slice(linear, slice_name, weight, source, prefix + module, bias, shard)
        else:
            linear.load_slice(slice_name, weight, bias)

    _copy(model.embed_tokens.weight, get("embed_tokens.weight"), prefix + "embed_tokens.weight")
    _copy(model.norm.weight, get("norm.weight"), prefix + "norm.weight")
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        _copy(layer.input_layernorm.weight, get(p + "input_layernorm.weight"), prefix + p + "input_layernorm")
        _copy(layer.post_attention_layernorm.weight, get(p + "post_attention_layernorm.weight"),
              prefix + p + "post_attention_layernorm")
        for name in ("q_proj", "k_proj", "v_proj"):
            load(layer.attn.qkv_proj, name, f"{p}self_attn.{name}", maybe(f"{p}self_attn.{name}.bias"))
        load(layer.attn.o_proj, "o_proj", p + "self_attn.o_proj")
        for name in ("gate_proj", "up_proj"):
            load(layer.mlp.gate_up_proj, name, f"{p}mlp.{name}")
        load(layer.mlp.down_proj, "down_proj", p + "mlp.down_proj")
    if model.lm_head is not None:
        head = next((h for h in LM_HEADS if h in source), None)
        if head is None:
            raise KeyError(f"the config does not tie word embeddings but no LM head is stored ({LM_HEADS})")
        _copy(model.lm_head, source.get(head), head)


def load_submodule(module: nn.Module, source: WeightSource, prefixes: tuple[str, ...], what: str) -> None:
    """Loads every parameter and persistent buffer of `module` from the first prefix that holds them.

    A `vision_model.` level (CLIP wrappers of some transformers versions) may or may not be
    present on either side, so names are matched with it removed.
    """
    def norm(name: str) -> str:
        return name.replace("vision_model.", "")

    wanted = {norm(k): t for k, t in module.state_dict().items()}
    for prefix in prefixes:
        found = {norm(n[len(prefix):]): n for n in source.names() if n.startswith(prefix)}
        if not found:
            continue
        missing = sorted(set(wanted) - set(found))
        if missing:
            raise KeyError(f"{what}: checkpoint tensors under {prefix!r} lack {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}")
        with torch.no_grad():
            for key, target in wanted.items():
                _copy(target, source.get(found[key]), found[key])
        return
    raise KeyError(f"{what}: no checkpoint tensors under any of {prefixes}")
