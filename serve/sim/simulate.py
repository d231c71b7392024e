"""A discrete-event simulator: a policy serves a trace on a cost profile instead of a GPU.

It drives the engine's own torch-free parts, so the simulation cannot drift from what the
engine does: the scheduler (continuous batching, chunked prefill, admission under the batch size
and token budget, preemption when K/V blocks run out), its block manager, and the step planner
that asks the policy for a decision every step and applies the mode. What a GPU would do is
replaced by the profile: a mode switch costs the profile's switch time, a step the profile's
step time for that batch in that mode, and the clock advances by both. The profile given to
`simulate` stands for the device; the policy plans with its own (`policy.profile`), so a policy
profiled on one GPU can be run on another's profile, and a policy that learns is handed every
step's simulated time as the engine hands it the measured one (planner.observe_step). Measured
step and switch times (an engine's `step_log` and switch log) can be replayed in their order
instead, to check that simulator and engine decide alike. K/V memory is unbounded
unless `kv_blocks` is given. Useful for tests, for quick CPU what-if studies and for checking
that no request starves.

An engine's steps are not all the profile's, which times synthetic steps without pictures:
`host_ms` and `image_ms_per_ktoken` add the host work and the vision tower, `step_noise` scales
each step by a seeded lognormal factor, `spike_share` of the steps take `spike_ms` longer,
`stalls` make the step running at a given time take longer (the same hiccup at the same time for
every policy), and `first_use_ms` charges the first step of each kind (a kernel compiled on first
use). The device's `profile` may also differ from the one the policy plans with (a mode dearer on
the GPU than its profile says): what-ifs of the gaps between a profile and a GPU.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence as Trace
from dataclasses import dataclass, field

from serve.engine.block_manager import BlockManager
from serve.engine.planner import StepPlanner
from serve.engine.scheduler import Scheduler, SchedulerConfig
from serve.engine.sequence import MMSpan, Sequence
from serve.orchestrator.base import Policy
from serve.orchestrator.metrics import Metrics, RequestRecord, summarize
from serve.orchestrator.profile import CostProfile, batch_shape
from serve.orchestrator.types import Mode, RequestView


@dataclass
class SimConfig:
    max_batch_size: int = 32
    max_tokens_per_step: int = 4096
    chunked_prefill: bool = True
    initial_mode: Mode = field(default_factory=Mode.unmerge)
    idle_tick_ms: float = 1.0  # clock advance when the policy runs nothing while requests wait
    max_sim_ms: float | None = None  # stop here (requests not finished stay unfinished)
    keep_timeline: bool = False
    kv_blocks: int | None = None  # K/V cache blocks; None: as many as the batch can ever hold (never short)
    kv_block_size: int = 16
    # replayed in order instead of the profile's times (measured on an engine); past their end, the profile's
    step_times_ms: Trace[float] | None = None
    switch_times_ms: Trace[float] | None = None
    # what an engine's step costs beyond the profile's (which times synthetic steps without pictures):
    # host work per step (scheduling, inputs, sampling) and the vision tower per 1000 image tokens encoded
    host_ms: float = 0.0
    image_ms_per_ktoken: float = 0.0
    step_noise: float = 0.0  # sigma of a lognormal factor on each step's time (0: the profile's exactly)
    noise_seed: int = 0
    # (at_ms, extra_ms): the first step that starts at or after at_ms takes extra_ms longer
    stalls: Trace[tuple[float, float]] = ()
    # the first step of each kind (its LoRA operator or none; decode or prefill) takes this much longer:
    # the kernels a GPU compiles the first time a step needs them, for every policy alike
    first_use_ms: float = 0.0
    spike_share: float = 0.0  # this share of steps (seeded with the noise) take spike_ms longer
    spike_ms: float = 0.0
    # time the host side of each step (the planner's plan() and observe_step() on time.perf_counter):
    # what the policy costs the engine's step loop, which runs it in series with the GPU
    time_host: bool = False
    # advance the clock by that host time too, as the engine's serial step loop pays it (wall-clock
    # times of this host: the simulation is then no longer reproducible run to run)
    charge_host: bool = False

    def __post_init__(self) -> None:
        for name in ("host_ms", "image_ms_per_ktoken", "step_noise", "first_use_ms", "spike_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.spike_share <= 1:
            raise ValueError(f"spike_share must lie in [0, 1], got {self.spike_share}")
        if any(len(s) != 2 or not s[1] >= 0 for s in self.stalls):
            raise ValueError(f"stalls must be (at_ms, extra_ms >= 0) pairs, got {list(self.stalls)}")


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
    # with SimConfig.time_host, per step that ran: (plan us, observe_step us, waiting + running requests)
    host_us: list[tuple[float, float, int]] = field(default_factory=list)


class _ProfileSwitcher:
    """The adapter side of the step planner, on the profile: merging costs the profile's switch time."""

    def __init__(self, profile: CostProfile, op: str, merged: str | None, replay: Trace[float] | None = None):
        self.profile, self.op, self.merged = profile, op, merged
        self.switch_times_ms: list[float] = []
        self.replay, self.switches = list(replay or ()), 0

    def set_merged(self, name: str | None) -> None:
        if name != self.merged:
            ms = self.profile.switch_cost_ms(self.op, self.merged, name)
            if self.switches < len(self.replay):  # one measured switch: the engine logs it whole, not per fold
                ms = self.replay[self.switches]
            self.switches += 1
            folds = (self.merged is not None) + (name is not None)
            self.switch_times_ms += [ms / folds] * folds
            self.merged = name


def _sequence(r: RequestView, tokens_at: int) -> Sequence:
    # distinct token ids per request: the prefix cache is off, but the ids stay meaningless anyway
    head = r.output_mode == "head"
    # the images lead the prompt, as one span (what the planner prices and hands the policy as image tokens)
    spans = (MMSpan(0, r.image_tokens, f"{r.request_id}-images"),) if r.image_tokens else ()
    return Sequence(r.request_id, list(range(tokens_at, tokens_at + r.prompt_tokens)), max(1, r.output_tokens),
                    arrival_time=r.arrival_ms / 1e3, adapter=r.adapter, prefill_only=head, reuse_prefix=False,
                    mm_spans=spans)


def simulate(trace: Trace[RequestView], policy: Policy, profile: CostProfile,
             config: SimConfig | None = None) -> SimResult:
    cfg = config or SimConfig()
    pending = sorted(trace, key=lambda r: (r.arrival_ms, r.request_id))
    views = {r.request_id: r for r in pending}
    if len(views) != len(pending):
        raise ValueError("trace: request_id values must be unique")
    records = {r.request_id: RequestRecord(r.request_id, r.app, r.adapter, r.arrival_ms, r.prompt_tokens,
                                           r.output_tokens, r.slo_ms) for r in pending}
    longest = max((r.prompt_tokens + r.output_tokens for r in pending), default=1) + 1
    blocks = cfg.kv_blocks or cfg.max_batch_size * -(-longest // cfg.kv_block_size) + 1
    scheduler = Scheduler(SchedulerConfig(cfg.max_batch_size, cfg.max_tokens_per_step, cfg.chunked_prefill, longest),
                          BlockManager(blocks, cfg.kv_block_size, enable_prefix_cache=False))
    now = pending[0].arrival_ms if pending else 0.0
    switcher = _ProfileSwitcher(profile, policy.switch_op, cfg.initial_mode.merged_adapter, cfg.switch_times_ms)
    replayed = list(cfg.step_times_ms or ())
    noise = random.Random(cfg.noise_seed)
    stalls = sorted(cfg.stalls)
    used: set[tuple] = set()  # kinds of step run so far (first_use_ms)
    planner = StepPlanner(policy, scheduler, switcher, cfg.max_batch_size, cfg.max_tokens_per_step,
                          request_info=lambda rid: (views[rid].app, views[rid].slo_ms, views[rid].priority),
                          clock=lambda: now)
    planner.mode = cfg.initial_mode
    switches, timeline = [], []
    mode_ms = dict.fromkeys(("unmerge", "merge", "mixture"), 0.0)
    steps = idle = next_arrival = 0
    host_us, clock, plan_us = [], time.perf_counter, 0.0
    while next_arrival < len(pending) or scheduler.has_unfinished():
        if cfg.max_sim_ms is not None and now > cfg.max_sim_ms:
            break
        while next_arrival < len(pending) and pending[next_arrival].arrival_ms <= now:
            scheduler.add(_sequence(pending[next_arrival], next_arrival * longest))
            next_arrival += 1
        if not scheduler.has_unfinished():
            now = pending[next_arrival].arrival_ms
            continue
        before, logged = planner.mode, planner.stats.switches
        queued = scheduler.num_queued + len(scheduler.running)
        t0 = clock()
        plan = planner.plan()
        plan_us = (clock() - t0) * 1e6
        if cfg.charge_host:
            now += plan_us / 1e3
        if planner.stats.switches > logged:
            ms = planner.stats.switch_ms_last
            switches.append(SwitchEvent(now, str(before), str(planner.mode), ms))
            now += ms
        was_waiting = {id(s) for s in scheduler.waiting}
        batch = scheduler.schedule(plan)
        if not batch.entries:
            idle += 1
            if idle > 1_000_000:
                raise RuntimeError(f"policy {policy.name} ran nothing for 10^6 steps with {len(scheduler.waiting)} "
                                   f"waiting and {len(scheduler.running)} running")
            tick = now + cfg.idle_tick_ms
            now = min(pending[next_arrival].arrival_ms, tick) if next_arrival < len(pending) else tick
            continue
        idle = 0
        mode = planner.mode
        admitted = 0
        for seq, _ in batch.entries:
            if id(seq) in was_waiting:
                admitted += 1
                if records[seq.request_id].first_scheduled_ms is None:
                    records[seq.request_id].first_scheduled_ms = now
        step_ms = profile.batch_ms(mode, [(seq.adapter, n) for seq, n in batch.entries], policy.lora_op)
        if cfg.host_ms or cfg.image_ms_per_ktoken:
            images = sum(s.end - s.start for seq, n in batch.entries for s in seq.mm_spans
                         if seq.num_computed_tokens <= s.start < seq.num_computed_tokens + n)
            step_ms += cfg.host_ms + cfg.image_ms_per_ktoken * images / 1e3
        if steps < len(replayed):
            step_ms = replayed[steps]
        elif cfg.step_noise:
            step_ms *= noise.lognormvariate(0.0, cfg.step_noise)
        if cfg.spike_share and noise.random() < cfg.spike_share:
            step_ms += cfg.spike_ms
        while stalls and stalls[0][0] <= now:
            step_ms += stalls.pop(0)[1]
        if cfg.first_use_ms:
            shape = batch_shape(mode, [(seq.adapter, n) for seq, n in batch.entries], policy.lora_op)
            kind = (shape[4] if shape[2] else None, shape[1] == shape[0])
            if kind not in used:
                used.add(kind)
                step_ms += cfg.first_use_ms
        if cfg.keep_timeline:
            timeline.append(StepEvent(now, str(mode), len(batch), batch.num_tokens, step_ms, admitted,
                                      len(plan.pause)))
        now += step_ms
        mode_ms[mode.kind] += step_ms
        steps += 1
        prefilling = {id(seq) for seq, n in batch.entries if seq.num_computed_tokens + n >= seq.prompt_len
                      and seq.num_computed_tokens < seq.prompt_len}
        sampled = {seq.seq_id: 0 for seq, n in batch.entries if seq.num_computed_tokens + n >= seq.num_tokens}
        finished = scheduler.postprocess(batch, sampled)
        t0 = clock()
        planner.observe_step(batch, step_ms / 1e3)  # as the engine does after each step
        observe_us = (clock() - t0) * 1e6
        if cfg.charge_host:
            now += observe_us / 1e3
        if cfg.time_host:
            host_us.append((plan_us, observe_us, queued))
        for seq, _ in batch.entries:
            rec = records[seq.request_id]
            if id(seq) in prefilling and rec.first_token_ms is None:
                rec.first_token_ms = now
        for seq in finished:
            records[seq.request_id].finish_ms = now
    ordered = [records[r.request_id] for r in pending]
    metrics = summarize(ordered, switches=len(switches), switch_ms=sum(s.ms for s in switches))
    return SimResult(ordered, metrics, switches, steps, mode_ms, policy.stats.as_dict(), timeline, host_us)
