"""The inference engine: paged K/V cache, attention kernels, continuous batching, sampling.

    engine = Engine(checkpoint_dir, EngineConfig(...))
    engine.add_request(Request(...)) -> request_id;  engine.step() -> [RequestOutput]
    engine.generate(requests) / engine.generate(requests, stream=True);  engine.abort(id);  engine.stats()

Roles (nano-vllm's split): `scheduler.py` and `block_manager.py` (no torch) decide what runs;
`model_runner.py` is the only part that touches the device; `attention.py` with the Triton
kernels in `prefill_kernel.py` / `decode_kernel.py` reads the paged cache; `context.py` holds
the per-step metadata every layer sees. Adapters live in serve/lora: the scheduler sees them
only through `AdapterGate` (ready / acquire / release), the runner through the step's LoraBatch.
"""

from .attention import PagedAttention, paged_attention_torch, store_kv
from .block_manager import BlockManager
from .config import EngineConfig
from .context import StepContext, get_context, set_context, step_context
from .decode_kernel import paged_decode
from .engine import Engine
from .prefill_kernel import paged_prefill
from .request import Request, RequestMetrics, RequestOutput, SamplingParams
from .sampling import sample
from .scheduler import AdapterGate, FCFSPolicy, ScheduledBatch, Scheduler, SchedulerConfig, SchedulingPolicy
from .sequence import MMSpan, Sequence, SequenceStatus
from .stats import EngineStats

__all__ = [
    "Engine", "EngineConfig", "EngineStats", "Request", "RequestOutput", "RequestMetrics", "SamplingParams",
    "Scheduler", "SchedulerConfig", "SchedulingPolicy", "FCFSPolicy", "ScheduledBatch", "AdapterGate", "BlockManager",
    "Sequence", "SequenceStatus", "MMSpan", "PagedAttention", "paged_attention_torch", "paged_prefill",
    "paged_decode", "store_kv", "sample", "StepContext", "get_context", "set_context", "step_context",
]
