"""Online stage: the inference engine, adapter pool, orchestrator and the RPyC service.

    from serve import Engine, EngineConfig, Request, SamplingParams
    engine = Engine("path/to/checkpoint", EngineConfig(device="cpu"))
    print(engine.generate(Request(prompt="How many cars?", images=[image])).text)

Floors, each importing only those below it:

    distributed            what starts and drives engines (tensor-parallel groups, Ray replicas)
    rpc, sim               the service over the engine (its client imports without torch);
                           the simulator, which drives the engine's own scheduler on a cost profile
    engine                 scheduler, block manager, step planner, model runner
    orchestrator, lora,    policies (torch-free); adapter pool and LoRA layers; the language
    models                 side, vision towers and tensor-parallel sharding
    forward                step context, paged attention and its kernels
    vlora_kernels/, adapters/    ATMM; the adapter directory contract

Names load on first use (the face is lazy).
"""

from .lazy import lazy_face

_EXPORTS = {name: ".engine" for name in
            ("Engine", "EngineConfig", "EngineStats", "Request", "RequestOutput", "SamplingParams")}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
