"""Building heads from their config and storing them beside a LoRA adapter.

On disk a head is two files: `<name>.safetensors` (the weights) and `<name>.json` (its
`HeadConfig`). The config alone rebuilds the module, so training and the server share one
format and no pickled code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .base import TaskHead
from .classify import BinaryHead, ClassifyHead, CountHead
from .config import HeadConfig
from .dense import DenseDetectHead
from .detect import DetectHead

HEAD_CLASSES: dict[str, type[TaskHead]] = {
    "classify": ClassifyHead,
    "count": CountHead,
    "detect": DetectHead,
    "binary": BinaryHead,
}


def build_head(config: HeadConfig | dict) -> TaskHead:
    """A freshly initialised head for `config` (a HeadConfig or its dict form)."""
    if isinstance(config, dict):
        config = HeadConfig.from_dict(config)
    if config.type == "detect" and config.pooling == "dense":
        return DenseDetectHead(config)
    return HEAD_CLASSES[config.type](config)


def head_paths(directory: str | Path, name: str = "head") -> tuple[Path, Path]:
    """(weights, config) paths of the head called `name` in `directory`."""
    directory = Path(directory)
    return directory / f"{name}.safetensors", directory / f"{name}.json"


def save_head(head: TaskHead, directory: str | Path, name: str = "head") -> Path:
    """Write `<name>.safetensors` and `<name>.json` into `directory` (created if missing)."""
    weights_path, config_path = head_paths(directory, name)
    weights_path.parent.mkdir(parents=True, exist_ok=True)
    # safetensors refuses shared or non-contiguous storage; clone gives each tensor its own.
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in head.state_dict().items()}
    save_file(state, str(weights_path), metadata={"format": "vlora-head", "type": head.config.type})
    config_path.write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")
    return weights_path


def load_head(directory: str | Path, name: str = "head", device: torch.device | str = "cpu",
              dtype: torch.dtype | None = None) -> TaskHead:
    """The head saved by `save_head`, in eval mode, on `device`.

    dtype: storage dtype of the parameters (e.g. torch.bfloat16 to save memory in the
    server); None keeps the saved dtype. The computation is fp32 either way.
    """
    weights_path, config_path = head_paths(directory, name)
    for path, what in ((config_path, "config"), (weights_path, "weights")):
        if not path.is_file():
            raise FileNotFoundError(f"head {what} file not found: {path} "
                                    f"(save_head(head, {str(Path(directory))!r}, name={name!r}) writes it)")
    try:
        config = HeadConfig.from_dict(json.loads(config_path.read_text()))
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise ValueError(f"{config_path}: not a valid head config: {err}") from err
    head = build_head(config)
    state = load_file(str(weights_path))
    expected = head.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if state[k].shape != expected[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(f"{weights_path}: does not match the config in {config_path.name} "
                         f"(missing {missing}, unexpected {unexpected}, wrong shape {wrong})")
    head.load_state_dict(state)
    head.to(device=device, dtype=dtype)
    return head.eval()
