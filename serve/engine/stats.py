"""Engine statistics: cache occupancy, queues, reuse counters, step times, modes and switches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve.forward import segment_plans

from .compile_watch import WATCH
from .garbage import PAUSES


@dataclass
class EngineStats:
    num_blocks: int
    blocks_in_use: int
    block_size: int
    waiting: int  # queue length
    running: int
    in_flight: int
    num_preemptions: int
    prefix_hit_tokens: int
    encoder_calls: int
    items_encoded: int
    encoder_cache_hits: int
    encoder_cache_size: int
    graph_steps: int
    eager_steps: int
    num_steps: int
    generated_tokens: int
    step_time_mean_ms: float
    step_time_last_ms: float
    step_times_ms: list[float]  # the most recent steps
    adapters_loaded: int = 0
    cpu_threads: int = 0  # torch's intra-op threads in the process that steps (`rpc.engine_threads`)
    adapters_resident: int = 0  # holding a device slot
    adapters_in_host_cache: int = 0
    adapter_swaps: int = 0  # copies of an adapter into a slot
    adapter_slot_evictions: int = 0
    adapter_host_reads: int = 0  # adapter directories read (at load, and again after host-cache eviction)
    policy: str = "fcfs"
    mode: str = "unmerge"  # in force now: unmerge | merge(a) | mixture(a)
    steps_by_mode: dict | None = None  # steps run in each mode kind
    mode_switches: int = 0  # changes of the merged adapter, each timed
    switch_ms_total: float = 0.0
    switch_ms_last: float = 0.0
    switch_failures: int = 0
    policy_stats: dict | None = None  # serve.orchestrator.PolicyStats.as_dict(): decisions, reasons histogram
    items_encoded_ahead: int = 0  # of items_encoded: encoded during the step before theirs (encode_ahead)
    kernel_compiles: dict | None = None  # Triton variants compiled before / after the warm-up (compile_watch)
    # the vision towers' attention on the thread that asked (the engine's): plans made, live calls at a planned
    # shape and at an unplanned one, segment lengths the warm-up never met (serve/forward/segment_plans.py)
    tower_attention: dict | None = None
    # waits for a tenant about to come back (serve/engine/anticipation.py): max_ms, waits, waited_ms, came_back, late
    anticipation: dict | None = None
    # the process's garbage collections (serve/engine/garbage.py): gen0/gen1/gen2 -> count, ms, max_ms
    gc: dict | None = None
    quiet_steps: int = 0  # steps where tenants over their share carried no prompt tokens (tenancy.step_caps)


def collect_stats(engine) -> EngineStats:
    bm, sched, runner = engine.block_manager, engine.scheduler, engine.runner
    times = [t * 1e3 for t in engine.step_times]
    return EngineStats(
        num_blocks=bm.num_blocks, blocks_in_use=bm.num_used_blocks, block_size=bm.block_size,
        waiting=sched.num_queued, running=len(sched.running), in_flight=len(engine._requests),
        num_preemptions=sched.num_preemptions, prefix_hit_tokens=bm.prefix_hit_tokens,
        encoder_calls=runner.counters["encoder_calls"], items_encoded=runner.counters["items_encoded"],
        encoder_cache_hits=runner.encoder_cache.hits, encoder_cache_size=len(runner.encoder_cache),
        graph_steps=runner.counters["graph_steps"], eager_steps=runner.counters["eager_steps"],
        num_steps=engine.num_steps, generated_tokens=engine.num_generated_tokens,
        step_time_mean_ms=sum(times) / len(times) if times else 0.0,
        step_time_last_ms=times[-1] if times else 0.0, step_times_ms=times[-256:],
        **(engine.lora.stats() if engine.lora is not None else {}),
        **_mode_stats(engine), items_encoded_ahead=runner.counters["items_encoded_ahead"],
        kernel_compiles=WATCH.stats() if WATCH.installed else None, tower_attention=segment_plans.stats(),
        anticipation=engine.anticipation.stats() if engine.anticipation is not None else None,
        gc=PAUSES.stats(), quiet_steps=sched.num_quiet_steps, cpu_threads=torch.get_num_threads(),
    )


def _mode_stats(engine) -> dict:
    orch = engine.planner
    m = orch.stats.as_dict()
    return {"policy": engine.config.policy, "mode": m["mode"], "steps_by_mode": m["steps_by_mode"],
            "mode_switches": m["switches"], "switch_ms_total": m["switch_ms_total"],
            "switch_ms_last": m["switch_ms_last"], "switch_failures": m["switch_failures"],
            "policy_stats": orch.policy.stats.as_dict() if orch.policy is not None else None}
