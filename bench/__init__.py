"""The product's benchmarks: the suites of `vlora bench` (conf/bench.yaml), each writing committed results.

Kept apart from the libraries they measure (nothing below imports from here). One writer of
results (`results.py`: the device's folder, CSV, JSON) serves every suite:

    kernels, kernels_report, merge         ATMM against baselines with roofline floors; all-layer merge
    engine                                 the engine against transformers generate
    adapters, adapter_parts, step_profile  adapters and heads in the engine (mixes, swaps, head
                                           latency; a decode step by kernel kind)
    serving, serving_replay, _stats, _traces   the orchestrator's policies replayed on the real
                                           engine; traces kept as their seeded specs
    scaling, scaling_setups                one engine vs replicas vs a tensor-parallel group
    streams, streams_load, _engine, _hf, _report   camera streams through the RPyC server
    vision                                 the Qwen vision path per camera chunk
    train, train_plain                     our trainer against plain transformers + PEFT
    soak, soak_server, _attacks, _load, _floods, _tenancy   every attack class against `vlora serve`
    engine_pipe                            the engine process's events reaching a busy front end
    offline_seeds                          the offline stage's default, fresh per seed (suite=offline)

One-off investigations do not live here: a question about one's own adapter is `vlora diagnose`;
the probes that answered the project's own questions left the tree, and each results folder they
wrote names the commit that last had them.
"""
