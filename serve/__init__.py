"""Online stage: the inference engine, adapter pool, orchestrator and the RPyC service.

    from serve import Engine, EngineConfig, Request, SamplingParams
    engine = Engine("path/to/checkpoint", EngineConfig(device="cpu"))
    print(engine.generate(Request(prompt="How many cars?", images=[image])).text)

Floors, each importing only those below it: rpc (service over the engine; its client imports
without torch) and distributed (what starts and drives engines) -> engine (scheduler, block
manager, model runner) and orchestrator (policies, torch-free) -> lora (adapter pool, LoRA
layers) and models (language side, vision towers, tensor-parallel sharding) -> forward (step
context, paged attention and its kernels) -> kernels/ (ATMM). Names load on first use.
"""

from .lazy import lazy_face

_EXPORTS = {name: ".engine" for name in
            ("Engine", "EngineConfig", "EngineStats", "Request", "RequestOutput", "SamplingParams")}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
