"""Offline stage: teachers (small models) distilled into datasets, and LoRA + task-head training.

Adapter training (this part of the package):

    vlm = VisionLM(ModelRef("qwen2_vl_tiny", path), LoraSpec(rank=16, alpha=32))
    data = load_domain("datasets/count_vehicles")             # domain.json + DatasetDict
    result = train_adapter(vlm, data, TrainConfig(epochs=4), checkpoint_dir="adapters/x")
    state = AdapterState(result.lora, {"count_vehicles": HeadState.of(result.head)}, ...)
    save_adapter(vlm, state, "adapters/x")                     # PEFT dir + heads/<domain>/ + meta.json
    evaluate(vlm, head, data)                                  # {"accuracy", "metric", "n", "task", "baseline"}
    compare_to_majority("count", preds, targets, train_labels) # the majority baseline's verdict (train/baselines.py)

    trainer = LoraTrainer(vlm, "datasets", TrainConfig())      # fusion.Trainer for fusion.fuse

    pretrain(zoo_dir, out_dir, PretrainConfig())               # make a random tiny zoo model learnable
    ref = pretrained_ref(ModelRef(...), out_dir, PretrainConfig())   # ... built once, then cached
"""

from .adapter_io import AdapterState, HeadState, load_adapter, read_meta, save_adapter
from .baselines import BASELINE_TASKS, compare_to_majority, domain_baseline
from .data import DomainData, DomainInfo, Encoded, Encoder, collate, load_domain
from .evaluate import METRICS, evaluate, greedy_decode
from .fusion_trainer import LoraTrainer
from .model import AdapterModule, LoraSpec, ModelRef, target_regex
from .pretrain import PretrainConfig, cached_pretrained, pretrain, pretrained_ref
from .trainer import TrainConfig, TrainResult, head_config_for, train_adapter
from .vlm import VisionLM

__all__ = [
    "ModelRef", "LoraSpec", "VisionLM", "AdapterModule", "target_regex",
    "DomainInfo", "DomainData", "load_domain", "Encoder", "Encoded", "collate",
    "TrainConfig", "TrainResult", "train_adapter", "head_config_for",
    "evaluate", "greedy_decode", "METRICS",
    "compare_to_majority", "domain_baseline", "BASELINE_TASKS",
    "AdapterState", "HeadState", "save_adapter", "load_adapter", "read_meta",
    "LoraTrainer",
    "PretrainConfig", "pretrain", "cached_pretrained", "pretrained_ref",
]
