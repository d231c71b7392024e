"""A recorded decision sequence of the V-LoRA policy on a scripted trace, for checking that a change
meant to cut the policy's host cost leaves every decision (and what it learnt) as it was.

The trace is the H200 run's workload (8 adapters, skewed popularity, video and retrieval requests with
their images) at 1.5x its capacity, served on a device whose deLoRA costs 4x the profile's with
seeded noise, so the queue holds tens of requests, every plan (unmerge, mixture, hold) is priced,
the cost model learns and the guard engages and releases."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from bench.policy_cost import with_images
from bench.serving_sim import device_profile
from bench.serving_traces import spec_of
from serve.orchestrator import CostProfile, build_policy, generate
from serve.sim import SimConfig, simulate

RUN = Path(__file__).resolve().parents[3] / "results/serving/nvidia_h200/i48_confirm"


def record(seconds: float = 3.0, rate: float = 30.0, seed: int = 3) -> list[str]:
    """One line per decision (mode, admitted ids, paused ids, reason with its prices, starving), then
    the learnt weights and the guard's report at the end."""
    profile = CostProfile.load(RUN / "profile.json")
    spec = json.loads((RUN / "traces.json").read_text())["trace_load_0.5_skew0.9_seed0.jsonl"]["spec"]
    spec = dataclasses.replace(spec_of(spec), rate=rate, duration_s=seconds, seed=seed)
    trace = with_images(generate(spec), spec)
    policy = build_policy("v_lora", profile, {"guard_window": 32, "guard_hold_steps": 48})
    lines = []
    decide = policy.decide

    def recorded(view):
        d = decide(view)
        lines.append(f"{d.mode}|{','.join(d.admit)}|{','.join(d.pause)}|{d.switch}|{d.starving}|{d.reason}")
        return d

    policy.decide = recorded
    result = simulate(trace, policy, device_profile(profile, 4.0),
                      SimConfig(32, 8192, step_noise=0.3, noise_seed=seed, image_ms_per_ktoken=10.0, host_ms=1.0))
    stats = result.policy_stats
    lines.append(f"weights {policy.costs.weights!r} {sorted(policy.costs._shape_log.items(), key=repr)!r}")
    lines.append("switch " + json.dumps(stats["learning"]["switch_ms"], sort_keys=True))
    guard = {k: v for k, v in stats["guard"].items()}
    lines.append("guard " + json.dumps(guard, sort_keys=True))
    lines.append(f"metrics {result.metrics.avg_token_latency_ms!r} {result.steps}")
    return lines


# (seconds, rate req/s, seed): the guard engages and releases; mostly unmerge; mostly mixture with a dwell
SCENARIOS = ((6.0, 30.0, 3), (5.0, 40.0, 1), (6.0, 25.0, 2))
GOLDEN = Path(__file__).with_name("v_lora_decisions.json")


def record_all() -> dict[str, list[str]]:
    return {f"{s:g}s_{r:g}rps_seed{n}": record(s, r, n) for s, r, n in SCENARIOS}


def digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


if __name__ == "__main__":  # python tests/serve/orchestrator/decision_trace.py: record the sequences anew
    runs = record_all()
    GOLDEN.write_text(json.dumps({k: {"sha256": digest(v), "lines": v} for k, v in runs.items()}, indent=0) + "\n")
    print({k: (len(v), digest(v)[:12]) for k, v in runs.items()})
