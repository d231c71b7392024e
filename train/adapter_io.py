"""Training's adapter state and how it is saved to an adapter directory (the layout is the
adapters package's: PEFT files, heads/<domain>/, meta.json with the base model (name, path and
weights fingerprint, adapters.base), the LoRA shape, and per domain: task, labels, head path,
metric and accuracy reached).

An `AdapterState` is LoRA weights (CPU tensors, PEFT keys) plus one `HeadState` per domain and
the domains' records. States are treated as values: training produces a new one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from adapters.base import base_identity
from adapters.heads import save_heads
from adapters.layout import HEADS_DIR, PEFT_FILES, PEFT_WEIGHTS
from adapters.meta import META_VERSION, read_meta, write_meta as write_meta_file
from heads import HeadConfig, TaskHead, build_head, load_head


@dataclass(frozen=True)
class HeadState:
    """A head as data: its config and CPU weights (never modified in place)."""

    config: dict
    weights: dict[str, Tensor]

    @classmethod
    def of(cls, head: TaskHead) -> HeadState:
        return cls(head.config.to_dict(), {k: v.detach().to("cpu", copy=True) for k, v in head.state_dict().items()})

    def build(self, device: torch.device | str = "cpu") -> TaskHead:
        """A fresh module holding a copy of the weights."""
        head = build_head(HeadConfig.from_dict(dict(self.config)))
        head.load_state_dict({k: v.clone() for k, v in self.weights.items()})
        return head.to(device)


@dataclass
class AdapterState:
    """One adapter: LoRA weights, a head per domain (none for lm domains), and domain records.

    domains[name]: {"task", "labels", "max_count", "max_boxes", "dataset", "steps", ...}, in the
    order the domains were trained in. `accuracies` memoises evaluations of exactly these
    weights (name -> {"accuracy", "metric", "n", "baseline"}); it is the only part filled in after creation.
    """

    lora: dict[str, Tensor]
    heads: dict[str, HeadState] = field(default_factory=dict)
    domains: dict[str, dict] = field(default_factory=dict)
    accuracies: dict[str, dict] = field(default_factory=dict)
    index: int = 0

    @property
    def order(self) -> list[str]:
        return list(self.domains)


def write_meta(path: Path, state: AdapterState, vlm, name: str, extra: dict | None = None) -> dict:
    lora = vlm.lora
    domains = {}
    for d, rec in state.domains.items():
        acc = state.accuracies.get(d, {})
        domains[d] = {**rec, "head": f"{HEADS_DIR}/{d}" if d in state.heads else None,
                      "accuracy": acc.get("accuracy"), "metric": acc.get("metric"), "n_eval": acc.get("n"),
                      # the score's majority baseline (train/baselines.py): a reader sees what it is worth
                      "baseline": acc.get("baseline"),
                      # beside it: the base model zero-shot and the teacher's agreement with the truth
                      "baselines": acc.get("baselines")}
    meta = {
        "name": name,
        "tasks": sorted({rec["task"] for rec in state.domains.values()}),
        "domains": domains,
        "order": state.order,
        # the base's identity with its weights fingerprint: the server checks it (adapters.base)
        "base_model": base_identity(vlm.ref.path, vlm.ref.name, arch=vlm.arch),
        "lora": {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                 "target_modules": list(lora.target_modules), "train_vision_tower": vlm.train_vision_tower},
        "created_by": "vlora train", "version": META_VERSION, **(extra or {}),
    }
    return write_meta_file(path, meta)


def save_adapter(vlm, state: AdapterState, path: str | Path, name: str | None = None,
                 extra_meta: dict | None = None) -> Path:
    """Write the adapter directory. The LoRA is written by PEFT itself (`save_pretrained` of the
    model holding these weights), so the directory is exactly what PEFT produces and loads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vlm.load_lora_state(state.lora)
    vlm.model.save_pretrained(str(path))
    save_heads(path, {domain: head.build() for domain, head in state.heads.items()})
    write_meta(path, state, vlm, name or path.name, extra_meta)
    return path


def load_adapter(path: str | Path) -> AdapterState:
    """The state saved by `save_adapter` (weights on CPU; accuracies as recorded in meta.json)."""
    path = Path(path)
    meta = read_meta(path)
    missing = [f for f in PEFT_FILES if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{path}: adapter directory lacks {missing}")
    lora = load_file(str(path / PEFT_WEIGHTS))
    heads, domains, accs = {}, {}, {}
    for d, rec in meta["domains"].items():
        if rec.get("head"):
            heads[d] = HeadState.of(load_head(path / rec["head"]))
        domains[d] = {k: v for k, v in rec.items() if k not in ("head", "accuracy", "metric", "n_eval", "baseline",
                                                               "baselines")}
        if rec.get("accuracy") is not None:
            accs[d] = {"accuracy": rec["accuracy"], "metric": rec["metric"], "n": rec["n_eval"]}
            if "baseline" in rec:  # meta written before baselines has none: the memo is then incomplete
                accs[d]["baseline"] = rec["baseline"]
            if rec.get("baselines") is not None:
                accs[d]["baselines"] = rec["baselines"]
    return AdapterState(lora, heads, domains, accs, int(meta.get("index", 0)))
