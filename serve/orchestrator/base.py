"""The policy base class (validation, stats, decision log) and the cost estimates policies share."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from .profile import CostProfile
from .types import Decision, DecisionRecord, Mode, PolicyStats, RequestView, StepView

log = logging.getLogger("serve.orchestrator")


def fcfs(requests: Iterable[RequestView]) -> list[RequestView]:
    return sorted(requests, key=lambda r: (r.arrival_ms, r.request_id))


class BatchEstimate:
    """Step-time estimates for the running batch plus one more request, in O(1) per query.

    The running requests are taken as decoding (one token each); `with_request` adds a request
    contributing `tokens` (its prompt for a prefill step, 1 for a decode step)."""

    def __init__(self, profile: CostProfile, mode: Mode, lora_op: str, running: Iterable[RequestView]):
        self.profile, self.mode = profile, mode
        self.op = "delora" if mode.kind == "mixture" else lora_op
        self.seqs = self.lora_tokens = 0
        self.adapters: set[str] = {mode.adapter} if mode.kind == "mixture" else set()
        for r in running:
            self.seqs += 1
            if mode.needs_lora(r.adapter):
                self.lora_tokens += 1
                if r.adapter is not None:
                    self.adapters.add(r.adapter)
        self._cache: dict[tuple, float] = {}

    def with_request(self, adapter: str | None, tokens: int) -> float:
        lora = self.mode.needs_lora(adapter)
        new_adapter = lora and adapter is not None and adapter not in self.adapters
        key = (lora, new_adapter, tokens)
        if key not in self._cache:
            lora_tokens = self.lora_tokens + (tokens if lora else 0)
            self._cache[key] = self.profile.step_ms(self.seqs + 1, self.seqs + tokens, lora_tokens,
                                                    len(self.adapters) + new_adapter, self.op)
        return self._cache[key]

    def exec_ms(self, r: RequestView) -> float:
        """Time to finish `r` if it joined the batch now: its prefill step, then one step per
        remaining output token (a head request finishes with its prefill)."""
        decode_steps = 0 if r.output_mode == "head" else max(0, r.remaining_output - 1)
        return (self.with_request(r.adapter, max(1, r.remaining_prompt))
                + decode_steps * self.with_request(r.adapter, 1))


class Policy:
    """Base class: `decide(view)` calls the subclass's `_decide`, checks the answer against the
    modes' rules, marks the switch, logs the decision and counts it in `stats`."""

    name = "base"
    lora_op = "atmm"  # operator of the LoRA branch in unmerge mode (the engine's kernel choice)
    switch_op = "atmm"  # how the weights are merged/unmerged: one-shot "atmm" or per-layer "addmm"

    def __init__(self, profile: CostProfile, log_size: int = 1000):
        self.profile = profile
        self.stats = PolicyStats()
        self.log: deque[DecisionRecord] = deque(maxlen=log_size)
        self.last_switch_ms = float("-inf")

    def _decide(self, view: StepView) -> Decision:
        raise NotImplementedError

    def decide(self, view: StepView) -> Decision:
        d = self._decide(view)
        self._check(view, d)
        switch = d.mode.merged_adapter != view.mode.merged_adapter
        d = Decision(d.mode, d.admit, d.pause, switch, d.reason, d.starving)  # (replace(d, switch=...), cheaper)
        s = self.stats
        s.decisions += 1
        s.steps_by_mode[d.mode.kind] += 1
        s.admitted += len(d.admit)
        s.paused += len(d.pause)
        s.max_starving = max(s.max_starving, d.starving)
        key = d.reason.split(":", 1)[0]
        s.reasons[key] = s.reasons.get(key, 0) + 1
        if switch:
            s.switches += 1
            s.switch_ms += self.profile.switch_cost_ms(self.switch_op, view.mode.merged_adapter,
                                                       d.mode.merged_adapter)
            self.last_switch_ms = view.now_ms
        rec = DecisionRecord(view.now_ms, str(d.mode), switch, len(d.admit), d.starving,
                             len(view.waiting), len(view.running), d.reason)
        self.log.append(rec)
        if switch or log.isEnabledFor(logging.DEBUG):
            log.log(logging.INFO if switch else logging.DEBUG, "%s t=%.1fms %s -> %s admit=%d starving=%d: %s",
                    self.name, view.now_ms, view.mode, d.mode, len(d.admit), d.starving, d.reason)
        return d

    def _check(self, view: StepView, d: Decision) -> None:
        """A policy bug must not reach the engine: admitted and running requests must be runnable."""
        waiting = {r.request_id: r for r in view.waiting}
        running = {r.request_id for r in view.running}
        if len(set(d.admit)) != len(d.admit) or any(i not in waiting for i in d.admit):
            raise RuntimeError(f"policy {self.name}: admit {d.admit} lists ids that are not waiting (or twice)")
        if any(i not in running for i in d.pause):
            raise RuntimeError(f"policy {self.name}: pause {d.pause} lists ids that are not running")
        bad = [i for i in d.admit if not d.mode.can_run(waiting[i].adapter)]
        paused = set(d.pause)
        bad += [r.request_id for r in view.running if r.request_id not in paused and not d.mode.can_run(r.adapter)]
        if bad:
            raise RuntimeError(f"policy {self.name}: requests {bad} cannot run in mode {d.mode}")

    def reset(self) -> None:
        self.stats = PolicyStats()
        self.log.clear()
        self.last_switch_ms = float("-inf")
