"""PEFT's half of an adapter directory: adapter_config.json and adapter_model.safetensors.

The server applies plain LoRA, so `read_config` refuses what it cannot apply exactly (DoRA, LoRA
biases, modules_to_save, other PEFT types) with the directory and the option named;
`read_tensors` reads the weights; `write_peft` writes a directory in the layout PEFT's
save_pretrained produces (for adapters made without a PEFT model, e.g. random benchmark ones).
"""

from __future__ import annotations

import json
from pathlib import Path

from .layout import PEFT_CONFIG as CONFIG_FILE
from .layout import PEFT_WEIGHTS as WEIGHTS_FILE


class AdapterLoadError(ValueError):
    """An adapter directory the server cannot serve; the message says which and why."""


def fail(path: Path, message: str) -> AdapterLoadError:
    """The error for `path`, naming it first (callers raise it)."""
    return AdapterLoadError(f"adapter directory {str(path)!r}: {message}")


def read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise fail(path, "does not exist or is not a directory")
    if not file.is_file():
        raise fail(path, f"no {CONFIG_FILE} (a PEFT LoRA directory holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise fail(path, f"{CONFIG_FILE} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise fail(path, f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise fail(path, f"peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    unsupported = [(k, config.get(k)) for k in ("use_dora", "lora_bias", "fan_in_fan_out") if config.get(k)]
    if config.get("bias", "none") != "none":
        unsupported.append(("bias", config["bias"]))
    if config.get("modules_to_save"):
        unsupported.append(("modules_to_save", config["modules_to_save"]))
    if unsupported:
        raise fail(path, f"unsupported LoRA options {dict(unsupported)}; the server applies plain LoRA "
                          "(use_dora=false, bias='none', no modules_to_save)")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise fail(path, f"{CONFIG_FILE} needs a positive number {key!r}, got {config.get(key)!r}")
    return config


def read_tensors(path: Path) -> dict:
    """PEFT key -> CPU tensor of adapter_model.safetensors; a missing or unreadable file is an AdapterLoadError."""
    file = path / WEIGHTS_FILE
    if not file.is_file():
        hint = " (adapter_model.bin is not read: save with safe_serialization=True)" \
            if (path / "adapter_model.bin").is_file() else ""
        raise fail(path, f"no {WEIGHTS_FILE}{hint}")
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as e:  # a truncated or garbled file: safetensors raises several types
        raise fail(path, f"{WEIGHTS_FILE} cannot be read ({type(e).__name__}: {e})") from e


def write_peft(path: str | Path, tensors: dict, config: dict) -> Path:
    """A PEFT LoRA directory: `tensors` (PEFT keys -> CPU tensors, see layout.peft_key) and its
    adapter_config.json (`config`, with PEFT's defaults for what it leaves out)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS_FILE))
    full = {"peft_type": "LORA", "lora_dropout": 0.0, "bias": "none", "task_type": None,
            "base_model_name_or_path": None, "inference_mode": True, **config}
    (path / CONFIG_FILE).write_text(json.dumps(full, indent=2))
    return path
