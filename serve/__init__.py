"""Online stage: the inference engine, adapter pool, orchestrator and the RPyC service.

    from serve import Engine, EngineConfig, Request, SamplingParams
    engine = Engine("path/to/checkpoint", EngineConfig(device="cpu"))
    print(engine.generate(Request(prompt="How many cars?", images=[image])).text)
"""

from .engine import Engine, EngineConfig, EngineStats, Request, RequestOutput, SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStats", "Request", "RequestOutput", "SamplingParams"]
