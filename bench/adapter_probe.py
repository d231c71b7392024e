"""A trained adapter on its base model, on the CPU, for the probes that score it item by item
(`bench.binary_misses`, `bench.qa_misses`)."""

from __future__ import annotations

import json
from pathlib import Path

from train import LoraSpec, VisionLM
from train.adapter_io import load_adapter
from train.model import ModelRef


def adapter_on_base(adapter: str | Path, model: str | None = None, lora: bool = True):
    """(vlm with the adapter's LoRA loaded and in eval mode, the adapter's state). The base is
    `model`, else the checkpoint the adapter's meta.json records. lora=False leaves the LoRA at
    zero: the base's own answers, through the same code."""
    state = load_adapter(adapter)
    meta = json.loads((Path(adapter) / "meta.json").read_text())
    spec = meta["lora"]
    vlm = VisionLM(ModelRef(name="base", path=model or meta["base_model"]["path"]),
                   LoraSpec(rank=spec["rank"], alpha=spec["alpha"], dropout=spec["dropout"],
                            target_modules=spec["target_modules"]),
                   device="cpu")
    if lora:
        vlm.load_lora_state(state.lora)
    vlm.model.eval()  # as train.evaluate scores it: no LoRA dropout
    return vlm, state
