"""Policies by name, built from plain config dicts (what conf/orchestrator/*.yaml holds)."""

from __future__ import annotations

import dataclasses

from .base import Policy
from .baselines import DLoRAATMMConfig, DLoRAATMMPolicy, DLoRAConfig, DLoRAPolicy, FCFSPolicy, MergeOnlyConfig, \
    MergeOnlyPolicy, UnmergedConfig, UnmergeOnlyPolicy
from .policy import VLoRAConfig, VLoRAPaperConfig, VLoRAPaperPolicy, VLoRAPolicy
from .profile import CostProfile

# name -> (policy class, its config dataclass)
POLICIES: dict[str, tuple[type[Policy], type]] = {
    "v_lora": (VLoRAPolicy, VLoRAConfig),
    "v_lora_paper": (VLoRAPaperPolicy, VLoRAPaperConfig),
    "merge_only": (MergeOnlyPolicy, MergeOnlyConfig),
    "unmerge_only": (UnmergeOnlyPolicy, UnmergedConfig),
    "dlora": (DLoRAPolicy, DLoRAConfig),
    "dlora_atmm": (DLoRAATMMPolicy, DLoRAATMMConfig),
    "fcfs": (FCFSPolicy, UnmergedConfig),
}


def build_policy(name: str, profile: CostProfile, params: dict | None = None) -> Policy:
    """`params` are the fields of the policy's config dataclass; a `name` key, if present, must agree."""
    params = dict(params or {})
    given = params.pop("name", name)
    if given != name:
        raise ValueError(f"policy params name {given!r} disagrees with the policy asked for, {name!r}")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; policies: {sorted(POLICIES)}")
    cls, config_cls = POLICIES[name]
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"policy {name!r} has no parameter(s) {unknown}; valid: {sorted(known)}")
    policy = cls(profile, config_cls(**params))
    needs = [policy.lora_op] + (["delora"] if isinstance(policy, VLoRAPolicy) else [])
    missing = [op for op in needs if op not in profile.lora]
    if missing or policy.switch_op not in profile.switch_ms:
        raise ValueError(f"policy {name!r} needs LoRA op(s) {needs} and switch op {policy.switch_op!r}; "
                         f"profile {profile.name!r} has {sorted(profile.lora)} and {sorted(profile.switch_ms)}")
    return policy
