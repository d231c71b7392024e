"""A serving replay reports, per replay, the policy's host time per step (the planner's plan and
observe, in series with the model step) and the mean measured model step, so a GPU run can tell a
policy's own host work from slower steps."""

from __future__ import annotations

from adapter_cases import one_thread  # noqa: F401 (autouse: one intra-op thread here)


def test_a_replay_reports_the_policys_host_time_and_the_mean_step_apart(vlora_home):
    from zoo import build_checkpoint

    from bench.serving import ServingBenchJob
    from bench.serving_replay import build_requests, replay
    from serve import Engine, EngineConfig
    from serve.orchestrator import generate

    ckpt = build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")
    engine = Engine(ckpt, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128, enable_prefix_cache=False,
                                       policy="unmerge_only"))
    job = ServingBenchJob(device="cpu", rates=(8.0,), skewness=(1.0,), adapters=1, duration_s=1.0, image_size=56,
                          video_head_share=0.0, video_frames=(1, 1), video_output_tokens=(2, 3),
                          retrieval_output_tokens=(2, 4), text_tokens=(4, 12))
    trace = generate(job.workload())
    requests = build_requests(trace, [], 56, seed=1, text_tokens=8, max_frames=1)
    for r in requests:
        r.adapter = None  # the base model
    first = engine.num_steps
    row, extra = replay(engine, trace, requests, drain_s=30.0, prepare_threads=0)
    assert row["completed"] == len(trace) >= 2
    steps = list(engine.step_times)[first:]
    assert extra["step_ms_mean"] == 1e3 * sum(steps) / len(steps)
    stats = engine.stats().policy_stats
    assert stats["host_steps"] >= len(steps) and extra["host_us_per_step"] == 1e3 * stats["host_ms"] / stats["host_steps"]
    assert 0 < extra["host_us_per_step"] < 1e3 * extra["step_ms_mean"]  # planning a base-model step is cheap
