"""Benchmarks and evaluations: commands that measure the packages below and write committed results.

Kept apart from the libraries they measure (nothing below imports from here). One writer of
results (`results.py`: the device's folder, CSV, JSON) serves every suite of `vlora bench`:

    kernels, kernels_report, merge    ATMM against baselines with roofline floors; all-layer merge
    engine                            the engine against transformers generate
    adapters, adapter_parts           adapters and heads in the engine (mixes, swaps, head latency)
    serving, serving_replay           the orchestrator's policies replayed on the real engine
    scaling, scaling_setups           one engine vs replicas vs a tensor-parallel group
    streams, streams_load, _hf, _report   camera streams through the RPyC server
"""
