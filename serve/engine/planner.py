"""The orchestrator in the engine: each step a policy picks the mode and the batch; switches are applied.

    orch = StepPlanner(policy, scheduler, adapters, max_batch_size, max_tokens_per_step, requests)
    plan = orch.plan()                  # StepView -> policy.decide -> switch weights -> StepPlan
    batch = scheduler.schedule(plan)    # pauses and admissions as decided

Every step builds one `StepView` from the scheduler's queues (RequestViews of waiting and running
sequences; times in ms on `time.perf_counter`, the clock of the sequences' arrival times) and
calls `policy.decide`. When the decision's merged adapter differs from the weights', the
adapter manager folds the old one out and the new one in (serve/lora/modes.py) before the step
runs, so a request running across the switch continues with the same function: its K/V cache
stays valid and its next tokens are those of the unmerged model. If the new adapter cannot get
a slot, the weights hold nothing (unmerge runs every request) and the step goes on.

Without a policy (EngineConfig.policy = "fcfs") `Engine.set_mode` sets the mode by hand and the
plan only enforces what the mode can run (merge(a): other requests wait or pause).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from serve.orchestrator import Mode, Policy, RequestView, StepView

from .scheduler import Scheduler, StepPlan, fair_interleave
from .sequence import Sequence
from .tenancy import flow_of, tenant_turns


@dataclass
class ModeStats:
    """What the engine measured about modes (the policy counts its own decisions too)."""

    mode: str = "unmerge"
    steps_by_mode: Counter = field(default_factory=Counter)
    switches: int = 0  # changes of the merged adapter (merge(a) -> merge(b) is one switch of two folds)
    switch_ms_total: float = 0.0
    switch_ms_last: float = 0.0
    switch_failures: int = 0  # an adapter could not be merged (no slot): the step ran in unmerge
    switch_log: deque = field(default_factory=lambda: deque(maxlen=1024))  # (from, to, ms)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "steps_by_mode": dict(self.steps_by_mode), "switches": self.switches,
                "switch_ms_total": self.switch_ms_total, "switch_ms_last": self.switch_ms_last,
                "switch_failures": self.switch_failures}


def request_view(seq: Sequence, app: str | None = None, slo_ms: float | None = None,
                 priority: float = 1.0, max_model_len: int | None = None) -> RequestView:
    """max_model_len: a sequence never outgrows it, so its expected output is capped there (a request's
    max_tokens may be any int, and 10**400 decode steps times a step's ms overflow a float)."""
    head = seq.prefill_only
    output = 1 if head else max(1, seq.max_tokens)
    if max_model_len is not None:  # (and a running one has at least one token still to come)
        output = max(min(output, max_model_len - seq.prompt_len), seq.num_generated + 1)
    computed = min(seq.num_computed_tokens, seq.prompt_len)
    images = sum(s.end - max(s.start, computed) for s in seq.mm_spans if s.end > computed)
    return RequestView(seq.request_id, seq.adapter, seq.arrival_time * 1e3, max(1, seq.prompt_len),
                       output, "head" if head else "generate", app, slo_ms,
                       priority, computed, seq.num_generated, min(images, max(1, seq.prompt_len)))


def step_image_tokens(entries) -> int:
    """Image placeholder tokens first reached by the step just run (entries = [(seq, tokens)], the
    sequences already advanced past it): the images the vision tower encoded for it."""
    total = 0
    for seq, n in entries:
        start = seq.num_computed_tokens - n
        total += sum(s.end - s.start for s in seq.mm_spans if start <= s.start < start + n)
    return total


class StepPlanner:
    def __init__(self, policy: Policy | None, scheduler: Scheduler, adapters, max_batch_size: int,
                 max_tokens_per_step: int, request_info=None, clock=None):
        """adapters: serve.lora.AdapterManager with modes enabled, or None (base model only: always
        unmerge); anything with its `set_merged(name | None)` and `switch_times_ms` does (the
        simulator's cost-model switcher); request_info(request_id) -> (app, slo_ms, priority) of a
        request; clock() -> now in ms (time.perf_counter's by default; the simulator's own clock)."""
        self.scheduler, self.adapters = scheduler, adapters
        self.policy = policy
        self.max_batch_size, self.max_tokens_per_step = max_batch_size, max_tokens_per_step
        self.request_info = request_info or (lambda _rid: (None, None, 1.0))
        self.clock = clock or (lambda: time.perf_counter() * 1e3)
        self._views: dict[int, tuple] = {}  # seq_id -> ((computed, tokens), RequestView) of the last view
        self.mode = Mode.unmerge()
        self.stats = ModeStats()
        self.tp = None  # serve.models.parallel.TPGroup when this engine is one rank of a tensor-parallel group
        self.max_model_len = getattr(getattr(scheduler, "config", None), "max_model_len", None)
        self._folds = 0  # weight folds applied by switches (merge(a) -> merge(b) is two)
        self._switches_seen = (0, 0.0, 0)  # (switches, switch ms, folds) already handed to the policy

    @property
    def policy(self) -> Policy | None:
        return self._policy

    @policy.setter
    def policy(self, policy: Policy | None) -> None:
        """A policy plans with the cost of its operators, so the steps and switches run those
        (dLoRA's einsum and per-layer switches, or ATMM and the one-shot switch); no policy: ATMM."""
        self._policy = policy
        if hasattr(self.adapters, "use_operator"):
            self.adapters.use_operator(getattr(policy, "lora_op", "atmm"), getattr(policy, "switch_op", "atmm"))

    # ---- switching -------------------------------------------------------------------------
    def apply(self, mode: Mode) -> Mode:
        """Brings the weights to `mode`; returns the mode in force (unmerge if the merge failed)."""
        if mode.merged_adapter != self.mode.merged_adapter:
            if self.adapters is None:
                raise ValueError(f"mode {mode} needs adapters, but this engine serves the base model only")
            folds = len(self.adapters.switch_times_ms)
            try:
                self.adapters.set_merged(mode.merged_adapter)
            except ValueError:  # the old adapter is folded out already; the new one found no slot
                self.stats.switch_failures += 1
                mode = Mode.unmerge()
            ms = sum(self.adapters.switch_times_ms[folds:])
            self._folds += len(self.adapters.switch_times_ms) - folds
            if mode.merged_adapter != self.mode.merged_adapter:
                s = self.stats
                s.switches += 1
                s.switch_ms_total += ms
                s.switch_ms_last = ms
                s.switch_log.append((str(self.mode), str(mode), ms))
        self.mode = mode
        self.stats.mode = str(mode)
        return mode

    # ---- one step --------------------------------------------------------------------------
    def view(self, now_ms: float | None = None) -> StepView:
        now_ms = self.clock() if now_ms is None else now_ms
        sched = self.scheduler
        # a sequence's view changes only as it computes or generates tokens: reuse the last step's
        # view otherwise (a long waiting queue would be rebuilt every step)
        last, fresh = self._views, {}

        def views(seqs):
            out = []
            for s in seqs:
                key = (s.num_computed_tokens, len(s.token_ids))
                hit = last.get(s.seq_id)
                if hit is None or hit[0] != key:
                    hit = (key, request_view(s, *self.request_info(s.request_id), self.max_model_len))
                fresh[s.seq_id] = hit
                out.append(hit[1])
            return tuple(out)

        step = StepView(now_ms, views(sched.waiting), views(sched.running), self.mode, self.max_batch_size,
                        self.max_tokens_per_step)
        self._views = fresh
        return step

    def _decide(self):
        """The policy's decision; under tensor parallel rank 0 decides (its clock and queue view)
        and every other rank applies the same decision, so the ranks' batches never differ."""
        if self.tp is None or self.tp.world_size == 1:
            return self.policy.decide(self.view())
        return self.tp.from_leader(self.policy.decide(self.view()) if self.tp.rank == 0 else None)

    def _under_share(self, applied, taken: set, admitted, flows: dict) -> list[str]:
        """Waiting requests of tenants that run fewer than their weighted share of the batch, up to
        that share: the policy cuts its admit list to the free slots in its own order, so without
        these a tenant's second request could wait behind another tenant's whole backlog. Only with
        two or more tenants, and only requests the mode runs."""
        sched = self.scheduler
        weights = {s.tenant: s.tenant_weight for s in (*sched.running, *sched.waiting)}
        if len(weights) < 2:
            return []
        total = sum(weights.values())
        held = Counter(s.tenant for s in sched.running)
        held.update(flows[r][0] for r in admitted if r in flows)  # flows: waiting id -> (tenant, connection)
        room = {t: int(self.max_batch_size * w / total) - held[t] for t, w in weights.items()}
        out = []
        wanting = [s for s in sched.waiting if room[s.tenant] > 0 and s.request_id not in taken]
        for s in sched.policy.order(wanting) if wanting else ():  # the flooding tenant has no room: few to sort
            if room[s.tenant] > 0 and applied.can_run(s.adapter):
                room[s.tenant] -= 1
                out.append(s.request_id)
        return out

    def plan(self) -> StepPlan:
        start = time.perf_counter()
        try:
            return self._plan()
        finally:
            self._host(start, plan=True)

    def _host(self, start: float, plan: bool) -> None:
        """Charges the host time since `start` to the policy's stats (a step counts at its plan)."""
        if self._policy is not None:
            stats = self._policy.stats
            stats.host_ms += (time.perf_counter() - start) * 1e3
            stats.host_steps += plan

    def _plan(self) -> StepPlan:
        sched = self.scheduler
        if self.policy is None:  # a mode set by hand: enforce only what it can run
            mode = self.mode
            pause = frozenset(s.request_id for s in sched.running if not mode.can_run(s.adapter))
            admit = tuple(s.request_id for s in sched.policy.order(sched.waiting) if mode.can_run(s.adapter))
            self.stats.steps_by_mode[mode.kind] += 1
            return StepPlan(pause, admit)
        if not sched.waiting and not sched.running:
            return StepPlan()
        decision = self._decide()
        applied = self.apply(decision.mode)
        self.stats.steps_by_mode[applied.kind] += 1
        if applied != decision.mode:  # the merge failed: unmerge runs everyone, the policy's order first
            listed = set(decision.admit)
            rest = [s.request_id for s in sched.policy.order(sched.waiting) if s.request_id not in listed]
            return StepPlan(frozenset(), tuple(decision.admit) + tuple(rest))
        # the policy's order, with flows (a tenant's connection) taking turns: one flow's backlog cannot
        # starve another. A flow with nothing running gets its first request in even past the policy's
        # free slots (the scheduler preempts the busiest flow's latest for it), if the mode runs it.
        flows = {s.request_id: flow_of(s) for s in sched.waiting}
        holding = {flow_of(s) for s in sched.running}
        newcomers, seen = [], set()
        # (an empty batch is left to the policy; with no flow outside the batch nothing is sorted)
        outside = bool(holding) and any(f not in holding for f in flows.values())
        for s in sched.policy.order(sched.waiting) if outside else ():
            if flow_of(s) not in holding and flow_of(s) not in seen and applied.can_run(s.adapter):
                seen.add(flow_of(s))
                newcomers.append(s)
        newcomers = [s.request_id for s in tenant_turns(newcomers, sched.running)]  # tenants take turns first
        first = set(newcomers)
        extra = self._under_share(applied, set(decision.admit) | first, decision.admit, flows)
        admit = newcomers + [r for r in fair_interleave(list(decision.admit) + extra, flows.get) if r not in first]
        return StepPlan(frozenset(decision.pause), tuple(admit))

    def observe_step(self, batch, seconds: float) -> None:
        """The step just run (its ScheduledBatch, sequences already advanced) and its measured wall
        time, handed to a policy that learns from the engine's own steps (`observe`), with the
        switches applied since the last step (their measured ms and folds)."""
        observe = getattr(self.policy, "observe", None)
        if observe is None or not batch.entries:
            return
        start = time.perf_counter()
        try:
            self._observe(observe, batch, seconds)
        finally:
            self._host(start, plan=False)

    def _observe(self, observe, batch, seconds: float) -> None:
        s = self.stats
        folds_now = self._folds
        seen_switches, seen_ms, seen_folds = self._switches_seen
        self._switches_seen = (s.switches, s.switch_ms_total, folds_now)
        switched = s.switches > seen_switches
        observe(self.mode, [(seq.adapter, n) for seq, n in batch.entries], seconds * 1e3,
                step_image_tokens(batch.entries), s.switch_ms_total - seen_ms if switched else 0.0,
                folds_now - seen_folds if switched else 0)
