"""The orchestrator's scheduling policies and the tools to evaluate them (no torch here).

Each iteration the engine's scheduler hands a policy a `StepView` (waiting and running
requests, the current mode, batch limits, the time) and gets a `Decision`: the mode for the
step (unmerge | merge(adapter) | mixture(adapter)), which waiting requests to admit, which
running ones to pause, and why. Policies plan with a `CostProfile` measured at engine start.

    from serve.orchestrator import build_policy, assumed_profile, WorkloadSpec, generate
    from serve.sim import simulate                   # one floor up: it drives the engine's scheduler
    profile = assumed_profile()                      # or CostProfile.load("profile.json")
    policy = build_policy("v_lora", profile, {"tolerance": 0.5})
    result = simulate(generate(WorkloadSpec(rate=6, skewness=0.8)), policy, profile)
    print(result.metrics.avg_token_latency_ms, result.metrics.switches)
"""

from .assumed import assumed_profile
from .base import BatchEstimate, Policy, fcfs
from .baselines import DLoRAATMMConfig, DLoRAATMMPolicy, DLoRAConfig, DLoRAPolicy, FCFSPolicy, MergeOnlyConfig, \
    MergeOnlyPolicy, UnmergedConfig, UnmergeOnlyPolicy
from .metrics import Metrics, RequestRecord, percentile, summarize
from .policy import VLoRAConfig, VLoRAPaperConfig, VLoRAPaperPolicy, VLoRAPolicy
from .profile import LORA_OPS, SWITCH_OPS, CostProfile, Grid2D, ProfileShapes, StepShape, measure_profile
from .registry import POLICIES, build_policy
from .types import MODE_KINDS, Decision, DecisionRecord, Mode, PolicyStats, RequestView, StepView
from .workload import AppSpec, WorkloadSpec, adapter_names, generate, popularity, read_trace, \
    video_analytics, visual_retrieval, write_trace

__all__ = [
    "AppSpec", "BatchEstimate", "CostProfile", "DLoRAATMMConfig", "DLoRAATMMPolicy", "DLoRAConfig", "DLoRAPolicy", "Decision", "DecisionRecord",
    "FCFSPolicy", "Grid2D", "LORA_OPS", "MODE_KINDS", "MergeOnlyConfig", "MergeOnlyPolicy", "Metrics", "Mode",
    "POLICIES", "Policy", "PolicyStats", "ProfileShapes", "RequestRecord", "RequestView", "SWITCH_OPS",
    "StepShape", "StepView", "UnmergeOnlyPolicy", "UnmergedConfig", "VLoRAConfig",
    "VLoRAPaperConfig", "VLoRAPaperPolicy", "VLoRAPolicy", "WorkloadSpec", "adapter_names", "assumed_profile", "build_policy", "fcfs", "generate",
    "measure_profile", "percentile", "popularity", "read_trace", "summarize",
    "video_analytics", "visual_retrieval", "write_trace",
]
