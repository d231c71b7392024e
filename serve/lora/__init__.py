"""Adapters in the engine: the unified adapter pool, LoRA layers on ATMM and task heads.

Four tiers, each importing only the ones below (vLLM's vllm/lora shape):

    vlora_kernels/        ATMM ops: add_lora (Triton) / lora_reference (PyTorch), build_segments
    metadata.py     LoraBatch: the step's tokens grouped by pool slot, built once per step;
                    LoraGraphBuffers: the same in fixed device buffers for CUDA-graph decode
    layers.py       LoRALinear: base matmul once + the op over the batch's adapters
    manager.py      AdapterManager: registry, slots with LRU and pinning, host cache, swaps on a
                    side stream; the scheduler's AdapterGate (ready / acquire / release)

    pool.py         AdapterPool (stacked device slots) and HostCache; loader.py reads PEFT
                    directories into the pool layout; heads.py loads and picks task heads.

The engine owns one AdapterManager (Engine.load_adapter / unload_adapter / list_adapters).
"""

from .heads import load_adapter_heads, run_head, select_head
from .layers import LoRALinear, wrap_projections
from .loader import AdapterLoadError, AdapterSpec, AdapterWeights, ProjectionShape, model_shapes, read_adapter
from .manager import AdapterManager, AdapterRecord
from .metadata import LoraBatch, LoraGraphBuffers, build_lora_batch, resolve_backend
from .pool import ALL_TARGETS, AdapterPool, HostCache, PoolConfig

__all__ = [
    "AdapterManager", "AdapterRecord", "AdapterPool", "HostCache", "PoolConfig", "ALL_TARGETS",
    "LoRALinear", "wrap_projections", "LoraBatch", "LoraGraphBuffers", "build_lora_batch", "resolve_backend",
    "AdapterLoadError", "AdapterSpec", "AdapterWeights", "ProjectionShape", "model_shapes", "read_adapter",
    "load_adapter_heads", "select_head", "run_head",
]
