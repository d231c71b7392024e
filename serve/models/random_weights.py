"""Random weights of a checkpoint's architecture, made one tensor at a time where they are loaded.

A model too large to write out (Qwen2-VL-72B: 146 GB at bf16) still needs real-shaped weights for
benchmarks. `RandomWeights` is a mapping name -> tensor for `load_model(path, weights=...)` (and the
builders of `LocalGroup` and the replicas) that holds no tensor: the names and shapes come from the
transformers model of the directory's config built on the meta device, and each tensor is drawn
when the loader asks for it, on `device`, in `dtype`. Values follow the zoo's random models
(transformers' own initialisation): norms 1, biases 0, every other weight N(0, initializer_range),
0.02 for Qwen2-VL and LLaVA, which keeps bf16 activations finite through all 80 layers of the 72B
shape (docs/scale_out.md). Each tensor's generator is seeded from `seed` and its name alone, so
every rank of a tensor-parallel group draws the same whole tensor and keeps its own part, and the
same name gives the same values in any order of loading.

    weights = RandomWeights("ckpt_dir", seed=0, dtype=torch.bfloat16, device="cuda:1")
    model, processor = load_model("ckpt_dir", weights=weights, device="cuda:1", tp=tp)

The directory needs config.json and the processor's files only (`bench.engine.build_random_model`
on the meta device writes them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

NORMAL, ONES, ZEROS = "normal", "ones", "zeros"


def tensor_seed(seed: int, name: str) -> int:
    """A generator seed of (seed, tensor name) alone: the same on every rank and process."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _initializer_range(config) -> float:
    for part in (getattr(config, "text_config", None), config):
        value = getattr(part, "initializer_range", None) if part is not None else None
        if value is not None:
            return float(value)
    return 0.02


def _layout(model) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (how its values are drawn, shape) of every tensor of a transformers model's state dict."""
    kinds = {}
    for prefix, module in model.named_modules():
        norm = "norm" in type(module).__name__.lower()  # LayerNorm, RMSNorm, Qwen2RMSNorm, ...
        for leaf, tensor in module.named_parameters(recurse=False):
            name = f"{prefix}.{leaf}" if prefix else leaf
            kind = ZEROS if leaf == "bias" else ONES if norm else NORMAL
            kinds[name] = (kind, tuple(tensor.shape))
    state = model.state_dict(keep_vars=True)
    missing = sorted(set(state) - set(kinds))
    if missing:  # persistent buffers: their values are no draw of ours
        raise ValueError(f"random weights: state-dict tensors that are no parameters: {missing[:5]}")
    return {name: kinds[name] for name in state}  # persistent tensors only, in the model's order


class RandomWeights(Mapping):
    """The state dict of checkpoint `path`'s architecture with seeded random values, made on access."""

    def __init__(self, path: str | Path, seed: int = 0, dtype: torch.dtype | str = torch.bfloat16, device="cpu"):
        from transformers import AutoConfig, AutoModelForImageTextToText

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} holds no config.json to draw random weights for")
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"random weights: dtype {dtype!r} is not a floating-point torch dtype")
        self.seed, self.device = int(seed), torch.device(device)
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        self.std = _initializer_range(config)
        with torch.device("meta"):  # names and shapes only: no memory
            model = AutoModelForImageTextToText.from_config(config)
        self._layout = _layout(model)

    def __getitem__(self, name: str) -> torch.Tensor:
        kind, shape = self._layout[name]  # KeyError for a name the architecture lacks, as a dict
        if kind == ONES:
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        if kind == ZEROS:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(tensor_seed(self.seed, name))
        return torch.empty(shape, dtype=self.dtype, device=self.device).normal_(0.0, self.std, generator=generator)

    def __iter__(self) -> Iterator[str]:
        return iter(self._layout)

    def __len__(self) -> int:
        return len(self._layout)

    def __contains__(self, name) -> bool:
        return name in self._layout

    def header(self, name: str) -> tuple[str, list[int]]:
        """(dtype, shape) of tensor `name` without drawing it (loader.WeightSource.header)."""
        return str(self.dtype), list(self._layout[name][1])
