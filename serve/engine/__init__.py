"""The inference engine: paged K/V cache, attention kernels, continuous batching, sampling.

    engine = Engine(checkpoint_dir, EngineConfig(...))
    engine.add_request(Request(...)) -> request_id;  engine.step() -> [RequestOutput]
    engine.generate(requests) / engine.generate(requests, stream=True);  engine.abort(id);  engine.stats()

Roles (nano-vllm's split): `scheduler.py` and `block_manager.py` (no torch) decide what runs;
`model_runner.py` is the only part that touches the device. Paged attention and the per-step
context every layer sees are one floor down, in serve/forward. Adapters live in serve/lora: the
scheduler sees them only through `AdapterGate` (ready / acquire / release), the runner through
the step's LoraBatch. The package face is lazy: importing the scheduler loads no torch.
"""

from serve.lazy import lazy_face

_EXPORTS = {
    "Engine": ".engine",
    "EngineConfig": ".config",
    "EngineStats": ".stats",
    "Request": ".request",
    "RequestOutput": ".request",
    "RequestMetrics": ".request",
    "SamplingParams": ".request",
    "Scheduler": ".scheduler",
    "SchedulerConfig": ".scheduler",
    "SchedulingPolicy": ".scheduler",
    "ArrivalOrder": ".scheduler",
    "ScheduledBatch": ".scheduler",
    "AdapterGate": ".scheduler",
    "BlockManager": ".block_manager",
    "Sequence": ".sequence",
    "SequenceStatus": ".sequence",
    "MMSpan": ".sequence",
    "sample": ".sampling",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
