"""A discrete-event simulator: a policy serves a trace on a cost profile instead of a GPU.

It mirrors the engine's iteration-level loop (continuous batching with chunked prefill): each
step it asks the policy for a decision, pays the switch (profile) when the merged adapter
changes, runs the running requests that are not paused (decode: one token; prefill: the next
chunk) and admits a prefix of `decision.admit` under the batch size and the token budget, and
advances the clock by the profile's step time for that batch in that mode. KV-cache memory is
not modelled. Useful for tests, for quick CPU what-if studies and for checking that no request
starves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from .base import Policy
from .metrics import Metrics, RequestRecord, summarize
from .profile import CostProfile
from .types import Mode, RequestView, StepView


@dataclass
class SimConfig:
    max_batch_size: int = 32
    max_tokens_per_step: int = 4096
    chunked_prefill: bool = True
    initial_mode: Mode = field(default_factory=Mode.unmerge)
    idle_tick_ms: float = 1.0  # clock advance when the policy runs nothing while requests wait
    max_sim_ms: float | None = None  # stop here (requests not finished stay unfinished)
    keep_timeline: bool = False


@dataclass
class SwitchEvent:
    now_ms: float
    src: str
    dst: str
    ms: float


@dataclass
class StepEvent:
    start_ms: float
    mode: str
    seqs: int
    tokens: int
    step_ms: float
    admitted: int
    paused: int


@dataclass
class SimResult:
    records: list[RequestRecord]
    metrics: Metrics
    switches: list[SwitchEvent]
    steps: int
    mode_ms: dict[str, float]  # time spent stepping in each mode kind
    policy_stats: dict
    timeline: list[StepEvent]


class _Live:
    """A request's progress in the simulator."""

    __slots__ = ("req", "rec", "computed", "generated")

    def __init__(self, req: RequestView):
        self.req, self.computed, self.generated = req, 0, 0
        self.rec = RequestRecord(req.request_id, req.app, req.adapter, req.arrival_ms, req.prompt_tokens,
                                 req.output_tokens, req.slo_ms)

    def view(self) -> RequestView:
        r = self.req
        return RequestView(r.request_id, r.adapter, r.arrival_ms, r.prompt_tokens, r.output_tokens, r.output_mode,
                           r.app, r.slo_ms, r.priority, self.computed, self.generated)


def simulate(trace: Sequence[RequestView], policy: Policy, profile: CostProfile,
             config: SimConfig | None = None) -> SimResult:
    cfg = config or SimConfig()
    pending = deque(sorted(trace, key=lambda r: (r.arrival_ms, r.request_id)))
    lives = {r.request_id: _Live(r) for r in pending}
    if len(lives) != len(pending):
        raise ValueError("trace: request_id values must be unique")
    waiting: dict[str, _Live] = {}
    running: list[_Live] = []
    mode = cfg.initial_mode
    now = pending[0].arrival_ms if pending else 0.0
    switches, timeline = [], []
    mode_ms = dict.fromkeys(("unmerge", "merge", "mixture"), 0.0)
    steps = idle = 0
    while pending or waiting or running:
        if cfg.max_sim_ms is not None and now > cfg.max_sim_ms:
            break
        while pending and pending[0].arrival_ms <= now:
            r = pending.popleft()
            waiting[r.request_id] = lives[r.request_id]
        if not waiting and not running:
            now = pending[0].arrival_ms
            continue
        view = StepView(now, tuple(w.req for w in waiting.values()), tuple(r.view() for r in running), mode,
                        cfg.max_batch_size, cfg.max_tokens_per_step)
        d = policy.decide(view)
        if d.mode.merged_adapter != mode.merged_adapter:
            ms = profile.switch_cost_ms(policy.switch_op, mode.merged_adapter, d.mode.merged_adapter)
            switches.append(SwitchEvent(now, str(mode), str(d.mode), ms))
            now += ms
        mode = d.mode

        budget, batch, paused = cfg.max_tokens_per_step, [], set(d.pause)
        for r in running:
            if r.req.request_id in paused or budget <= 0:
                continue
            need = r.req.prompt_tokens - r.computed if r.computed < r.req.prompt_tokens else 1
            n = min(need, budget)
            if n < need and not cfg.chunked_prefill:
                continue
            batch.append((r, n))
            budget -= n
        admitted = 0
        for rid in d.admit:
            if len(running) >= cfg.max_batch_size or budget <= 0:
                break
            r = waiting[rid]
            n = min(r.req.prompt_tokens, budget)
            if n < r.req.prompt_tokens and not cfg.chunked_prefill:
                break
            del waiting[rid]
            running.append(r)
            r.rec.first_scheduled_ms = now
            batch.append((r, n))
            budget -= n
            admitted += 1
        if not batch:
            idle += 1
            if idle > 1_000_000:
                raise RuntimeError(f"policy {policy.name} ran nothing for 10^6 steps with {len(waiting)} waiting "
                                   f"and {len(running)} running")
            now = min(pending[0].arrival_ms, now + cfg.idle_tick_ms) if pending else now + cfg.idle_tick_ms
            continue
        idle = 0
        step_ms = profile.batch_ms(mode, [(r.req.adapter, n) for r, n in batch], policy.lora_op)
        if cfg.keep_timeline:
            timeline.append(StepEvent(now, str(mode), len(batch), sum(n for _, n in batch), step_ms,
                                      admitted, len(paused)))
        now += step_ms
        mode_ms[mode.kind] += step_ms
        steps += 1
        for r, n in batch:
            if r.computed < r.req.prompt_tokens:
                r.computed += n
                if r.computed < r.req.prompt_tokens:
                    continue  # a prefill chunk: nothing sampled yet
                r.rec.first_token_ms = now
            r.generated += 1
            if r.req.output_mode == "head" or r.generated >= r.req.output_tokens:
                r.rec.finish_ms = now
                running.remove(r)
    records = [lives[r.request_id].rec for r in sorted(trace, key=lambda r: (r.arrival_ms, r.request_id))]
    metrics = summarize(records, switches=len(switches), switch_ms=sum(s.ms for s in switches))
    return SimResult(records, metrics, switches, steps, mode_ms, policy.stats.as_dict(), timeline)
