"""Iteration-level scheduling with continuous batching (no torch here).

Every step the scheduler spends a token budget: running sequences first, in policy order
(one token for a decoding sequence, the next chunk of a prefilling one), then waiting
sequences are admitted while the budget, the batch size and the free blocks allow, each with
its cached prefix taken from the block manager and a first chunk of its prompt. A step may
therefore mix decode tokens, prefill chunks and fresh prompts. When a running sequence cannot
grow, the lowest-priority running sequence is preempted by recompute (its blocks are freed
and it waits again, at its old priority) rather than the step failing.

Adapters: a waiting sequence is admitted only when its adapter is usable on the device
(`AdapterGate.ready`, which starts the swap when it is not); until then it is skipped and the
rest of the queue goes on. A running sequence holds its adapter's slot (`acquire` at
admission, `release` when it finishes, is preempted or aborted), so a slot is never swapped
under a running sequence. Head-mode sequences (`prefill_only`) finish with reason "head" once
their prompt is computed.

Tenants (serve/engine/tenancy.py): the step's prompt tokens are shared by deficit round robin
over tenants (`Sequence.tenant`) by their weight, tokens nobody wants going round again; within a
tenant its share goes to its sequences in policy order. A flow (a tenant's connection, `owner`) with
nothing running is admitted first (and `_make_room` frees it a slot of a full batch and the blocks
of its first chunk), and at most `tenant_max_running` of a tenant's sequences run at once. While
several tenants have work, a tenant over its share of the batch carries at most the others'
per-weight tokens (`tenant_step_cap`), and while one within its share takes prompt tokens, none of
theirs (`tenant_quiet_prefill`, off by default, in at most a share of the steps that `tenant_quiet_rate`
sets). With one tenant every token is its own and the step is what it was before tenants.

The policy (serve/engine/order.py) says only who comes first. An orchestrator (serve/engine/planner.py) may
also hand `schedule` a `StepPlan`: running sequences it pauses are left out of the step (they
keep their blocks), and only the waiting sequences it lists are admitted, in its order.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .order import ArrivalOrder, FairShare, SchedulingPolicy, fair_interleave  # noqa: F401 (imported from here too)
from .sequence import Sequence, SequenceStatus
from .tenancy import (FairShares, busiest_flow, flow_of, newcomers_first, share_of, short_of_pictures, step_caps,
                      tenant_turns)


class AdapterGate:
    """What the scheduler asks about adapters; serve.lora's AdapterManager implements it.
    This default (no adapter side) reports every adapter usable."""

    def ready(self, adapter: str) -> bool:
        """Usable this step? If not, the implementation starts making it so (a swap)."""
        return True

    def acquire(self, adapter: str) -> None:
        """A sequence using `adapter` starts running."""

    def release(self, adapter: str) -> None:
        """A sequence using `adapter` stops running (finished, preempted or aborted)."""


def check_waiting_window(window) -> None:
    """SchedulerConfig.waiting_window (also checked by EngineConfig, before the model is built)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"waiting_window={window!r}: give the waiting requests per tenant each step looks at "
                         "(an integer >= 1), or null for all")


def check_quiet_rate(rate) -> None:
    """SchedulerConfig.tenant_quiet_rate (also checked by EngineConfig). Above 1 most steps could hold a
    flood's prompts out; NaN and bools are refused too."""
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
        raise ValueError(f"tenant_quiet_rate={rate!r}: give a number above 0 and at most 1 (quiet steps earned "
                         "per step that is not one)")


@dataclass
class SchedulerConfig:
    max_batch_size: int = 32  # sequences in one step
    max_tokens_per_step: int = 4096  # token budget of one step (prefill chunks + decode tokens)
    chunked_prefill: bool = True  # split prompts over steps; off: a prompt runs whole or waits
    max_model_len: int = 4096  # prompt + generated tokens of one sequence
    # prompt tokens a step may carry while some sequence is decoding (None: the whole budget): each
    # decode token waits for its step, so a step full of prefill makes every generated token slow.
    # 0: a decode lane: while any sequence decodes, steps carry decode tokens only (short steps, CUDA
    # graphs on a GPU), and after `decode_burst` of them in a row while prompts wait, one step takes
    # prompt tokens with the whole budget, so prompts are delayed, never starved
    max_prefill_with_decode: int | None = None
    decode_burst: int = 16
    # while several tenants have work, one over its share of the batch carries at most the others'
    # per-weight tokens (serve/engine/tenancy.py step_caps); off: the step is work-conserving
    tenant_step_cap: bool = True
    # with the cap: a step carrying prompt tokens of a tenant within its share carries none of those over
    # theirs (serve/engine/tenancy.py step_caps' `quiet_fits`). Off by default: on 2 CPU cores it did not
    # lower the soak's ratios (results/soak/cpu/quiet_steps); on an H100, covering every light prefill (rate 1),
    # it lowered them a little and cost a flood 19-29% of its requests (results/soak/nvidia_h100/quiet_steps)
    tenant_quiet_prefill: bool = False
    # quiet steps earned per step that is not one, so at most rate / (1 + rate) of the steps are quiet (0.5: a
    # third; 1: a half): the tenants over their share take prompt tokens in the rest whatever the others send
    tenant_quiet_rate: float = 0.5
    # with the cap: one over its share also runs at most the others' per-weight count of sequences in the step, or
    # one per SEQ_TOKENS of their tokens if more (tenancy.step_caps' `seq_cap`); off: any number, within its tokens
    tenant_seq_cap: bool = True
    # waiting sequences of one tenant that steps look at (its earliest, a connection's turn each first);
    # its later ones wait in its backlog, where no step reads them, and move up as these leave. Every step
    # orders and scans what waits: with 2,048 queued, plan + schedule took 4.3-7.3 ms a step on an H200's host
    # and 5.8-11.2 ms on 2 CPU cores, 0.3-0.4 ms with the window (bench/scheduler_cost.py,
    # results/soak/*/waiting_window). None: every waiting sequence is looked at
    waiting_window: int | None = 64

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_tokens_per_step < 1:
            raise ValueError("max_batch_size and max_tokens_per_step must be >= 1")
        check_waiting_window(self.waiting_window)
        if self.max_prefill_with_decode is not None and self.max_prefill_with_decode < 0:
            raise ValueError("max_prefill_with_decode must be >= 0 (0: a decode lane) or None")
        if self.decode_burst < 1:
            raise ValueError("decode_burst must be >= 1")
        check_quiet_rate(self.tenant_quiet_rate)


@dataclass(frozen=True)
class StepPlan:
    """One step's orders from the orchestrator (request ids)."""

    pause: frozenset[str] = frozenset()  # running requests left out of this step
    admit: tuple[str, ...] | None = None  # waiting requests that may be admitted, in order; None: all, by policy


@dataclass
class ScheduledBatch:
    entries: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        return bool(self.entries) and all(n == 1 for _, n in self.entries)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


QUIET_BURST = 4.0  # quiet steps a run of steps without one can save up


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, policy: SchedulingPolicy | None = None,
                 adapters: AdapterGate | None = None):
        self.config = config
        self.block_manager = block_manager
        self.policy = policy or ArrivalOrder()
        self.adapters = adapters or AdapterGate()
        self.waiting: list[Sequence] = []  # what steps look at: each tenant's earliest (config.waiting_window)
        self.running: list[Sequence] = []
        self.backlog: dict = {}  # tenant -> {flow: deque of its sequences past the window, in arrival order}
        self.num_backlogged = 0
        self._queued: Counter = Counter()  # tenant and flow -> its sequences in `waiting`
        self.num_preemptions = 0
        self.shares = FairShares()  # each step's prompt tokens by deficit round robin over flows
        self._caps: dict | None = None  # this step's tokens left to tenants over their share
        self._quiet = QUIET_BURST  # quiet steps that may run now
        self.num_quiet_steps = 0
        self._lane_steps = 0  # decode-only steps in a row while prompts waited (max_prefill_with_decode=0)

    # ---- queue --------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        cfg = self.config
        if seq.num_tokens >= cfg.max_model_len:
            raise ValueError(f"request {seq.request_id!r}: prompt of {seq.num_tokens} tokens leaves no room "
                             f"under max_model_len {cfg.max_model_len}")
        if not cfg.chunked_prefill and seq.num_tokens > cfg.max_tokens_per_step:
            raise ValueError(f"request {seq.request_id!r}: prompt of {seq.num_tokens} tokens exceeds "
                             f"max_tokens_per_step {cfg.max_tokens_per_step} with chunked prefill off")
        seq.status = SequenceStatus.WAITING
        window = cfg.waiting_window
        if window is not None and (seq.tenant in self.backlog or self._queued[seq.tenant] >= window):
            flow = flow_of(seq)
            flows = self.backlog.setdefault(seq.tenant, {})
            if flow in flows or not self._displace_for(seq):
                flows.setdefault(flow, deque()).append(seq)
                self.num_backlogged += 1
                return
        self._enqueue(seq)

    def _displace_for(self, seq: Sequence) -> bool:
        """Whether `seq` comes before the last of its tenant's window in the fair order (a connection's k-th
        before any's (k+1)-th): that one then goes back to the head of its connection's backlog, so a new
        connection's first request is looked at even behind another's thousands."""
        rank: Counter = Counter()
        last, last_key = None, (self._queued[flow_of(seq)], seq.arrival_time, seq.seq_id)
        for other in self.waiting:
            if other.tenant != seq.tenant:
                continue
            flow = flow_of(other)
            key = (rank[flow], other.arrival_time, other.seq_id)
            rank[flow] += 1
            if key > last_key:
                last, last_key = other, key
        if last is None:
            return False
        self._dequeue(last, refill=False)
        self.backlog[seq.tenant].setdefault(flow_of(last), deque()).appendleft(last)
        self.num_backlogged += 1
        return True

    @property
    def num_queued(self) -> int:
        """Sequences not running: those steps look at and the backlog."""
        return len(self.waiting) + self.num_backlogged

    def _enqueue(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._queued[seq.tenant] += 1
        self._queued[flow_of(seq)] += 1

    def _dequeue(self, seq: Sequence, refill: bool = True) -> None:
        """`seq` leaves `waiting`; its tenant's earliest in the backlog take its place."""
        self.waiting.remove(seq)
        for key in (seq.tenant, flow_of(seq)):
            self._queued[key] -= 1
            if not self._queued[key]:
                del self._queued[key]
        if refill:
            self._refill(seq.tenant)

    def _refill(self, tenant) -> None:
        """Backlogged sequences of `tenant` into `waiting` while its window has room: each time the one
        whose connection has the fewest waiting there, the earliest of those (the fair order's next)."""
        flows = self.backlog.get(tenant)
        while flows and self._queued[tenant] < self.config.waiting_window:
            flow = min(flows, key=lambda f: (self._queued[f], flows[f][0].arrival_time, flows[f][0].seq_id))
            self._enqueue(self._unbacklog(tenant, flow, flows[flow][0]))

    def _unbacklog(self, tenant, flow, seq: Sequence) -> Sequence:
        """`seq` out of its connection's backlog (emptied connections and tenants are forgotten)."""
        flows = self.backlog[tenant]
        flows[flow].remove(seq)
        self.num_backlogged -= 1
        if not flows[flow]:
            del flows[flow]
            if not flows:
                del self.backlog[tenant]
        return seq

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    if queue is self.running:
                        queue.remove(seq)
                        self._release(seq)
                    else:
                        self._dequeue(seq)
                    self.block_manager.free(seq)
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                    return seq
        for tenant, flows in self.backlog.items():
            for flow, queue in flows.items():
                for seq in queue:
                    if seq.request_id == request_id:
                        self._unbacklog(tenant, flow, seq)
                        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                        return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.num_backlogged)

    # ---- one step -------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        if seq.adapter is not None:
            self.adapters.release(seq.adapter)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.running.remove(seq)
        self.block_manager.free(seq)
        self._release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)  # looked at again at once, whatever its tenant's window holds

    def _make_room(self, plan: StepPlan) -> list[Sequence]:
        """Fair share of a full batch and of the KV blocks: a waiting sequence whose flow (tenant,
        connection) has nothing running gets a slot, and the blocks of its first chunk, by preempting
        (recompute) the latest sequences of the busiest flow (tenancy.busiest_flow). Work-conserving:
        with room in the batch and the blocks free, or one flow, nothing is preempted."""
        cfg = self.config
        holding = Counter(flow_of(s) for s in self.running)
        tenants = Counter(s.tenant for s in self.running)
        weight = {s.tenant: s.tenant_weight for s in self.running}
        allowed = None if plan.admit is None else set(plan.admit)
        newcomers: dict = {}  # flow -> its first waiting sequence
        for seq in self.waiting:
            f = flow_of(seq)
            if f in holding or f in newcomers or (allowed is not None and seq.request_id not in allowed):
                continue
            if seq.tenant_max_running is not None and tenants[seq.tenant] >= seq.tenant_max_running:
                continue
            newcomers[f] = seq
        victims, taken = [], 0
        for seq in tenant_turns(list(newcomers.values()), self.running):
            while len(self.running) + taken >= cfg.max_batch_size or not self._fits(seq):
                busiest = busiest_flow(holding, tenants, weight, seq.tenant)
                if busiest is None:
                    break
                victim = [s for s in self.policy.order(self.running) if flow_of(s) == busiest][-1]
                self.running.remove(victim)
                self._preempt(victim)
                holding[busiest] -= 1
                tenants[busiest[0]] -= 1
                if not holding[busiest]:
                    del holding[busiest]
                victims.append(victim)
            else:
                taken += 1  # its slot and blocks are there; one whose room no fair preemption makes waits
        return victims

    def _fits(self, seq: Sequence) -> bool:
        """Whether a waiting sequence's first chunk gets its blocks this step, after a block for each
        running sequence that grows into a new one. A chunk of more than half the cache counts as
        fitting: nothing is preempted for it (it waits for blocks as before)."""
        cfg, bm = self.config, self.block_manager
        cached = bm.num_cached_tokens(seq)
        chunk = min(seq.num_tokens - cached, cfg.max_tokens_per_step, cfg.max_prefill_with_decode or cfg.max_tokens_per_step)
        if bm.blocks_for(cached + chunk) - bm.blocks_for(cached) > bm.num_blocks // 2:
            return True
        growth = sum(bm.blocks_for(s.num_computed_tokens + 1) > len(s.block_table) for s in self.running)
        return bm.can_allocate(seq, cached + max(chunk, 1) + growth * bm.block_size)

    def schedule(self, plan: StepPlan | None = None) -> ScheduledBatch:
        cfg, bm = self.config, self.block_manager
        plan = plan or StepPlan()
        batch = ScheduledBatch()
        lane = self._decode_lane(plan)
        fair_victims = [] if lane else self._make_room(plan)  # nobody is admitted in a decode-only step
        budget = cfg.max_tokens_per_step
        running = self.policy.order(self.running)
        active = [seq for seq in running if seq.request_id not in plan.pause]
        # prompt tokens allowed in this step: capped while anyone decodes (a decode step stays short)
        decoding = cfg.max_prefill_with_decode is not None and cfg.chunked_prefill and any(
            seq.num_computed_tokens >= seq.prompt_len for seq in active)
        prefill = 0 if lane else (cfg.max_prefill_with_decode or budget) if decoding else budget
        if plan.admit is None:
            candidates = self.policy.order(self.waiting)
        else:
            by_id = {seq.request_id: seq for seq in self.waiting}
            candidates = [by_id[r] for r in plan.admit if r in by_id]
        if fair_victims:  # the slots they freed are the newcomers': they wait at least this step
            candidates = [seq for seq in candidates if seq not in fair_victims]
        candidates = newcomers_first(candidates, running)  # the slots _make_room freed are theirs
        # the step's prompt tokens, shared out between tenants (serve/engine/tenancy.py)
        decodes = sum(seq.num_computed_tokens >= seq.prompt_len for seq in active)
        capacity = max(0, min(budget - decodes, prefill))
        # a decode-only step shares out no prompt tokens: the tenants' turns and credits wait for the next
        slots = cfg.max_batch_size - len(running)
        allowance = {} if lane else self.shares.allowances(active, candidates, capacity, slots)
        # tokens left to each tenant over its share while others have work (tenancy.step_caps)
        self._caps = step_caps(active, candidates, slots, cached=bm.num_cached_tokens,
                               quiet_fits=allowance if self.quiet_ready() else None, seq_cap=cfg.tenant_seq_cap) \
            if cfg.tenant_step_cap and not lane else None
        if self._caps is not None and self._caps.quiet:
            self._quiet -= 1
            self.num_quiet_steps += 1
        else:
            self._quiet = min(QUIET_BURST, self._quiet + cfg.tenant_quiet_rate)
        used: Counter = Counter()
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            prompt_chunk = seq.num_computed_tokens < seq.prompt_len
            n = min(seq.num_remaining, budget, prefill if prompt_chunk else budget)
            if prompt_chunk:
                n = min(n, allowance.get(share_of(seq), 0))
            if self._caps is not None and seq.tenant in self._caps:
                n = self._caps.allow(seq.tenant, n, prompt_chunk)
                if prompt_chunk:
                    n = short_of_pictures(seq, seq.num_computed_tokens, n, self._caps.prompt_left(seq.tenant))
            if n <= 0 or seq.request_id in plan.pause or (not cfg.chunked_prefill and n < seq.num_remaining):
                i += 1
                continue
            while not bm.can_append(seq, n):
                victim = running.pop()  # lowest priority; never one scheduled already (those precede i)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.append(seq, n)
                batch.entries.append((seq, n))
                self._spend_cap(seq.tenant, n, prompt_chunk)
                budget -= n
                if prompt_chunk:
                    prefill -= n
                    allowance[share_of(seq)] -= n
                    used[share_of(seq)] += n
                i += 1
        self.running = running
        batch.preempted += fair_victims
        if lane:
            return batch
        if len(batch.preempted) > len(fair_victims):  # memory is short: admit no one this step
            self.shares.settle(allowance, used, capacity, carry=not cfg.chunked_prefill)
            return batch
        budget, prefill, skipped = self._admit(batch, candidates, budget, prefill, allowance, used)
        if skipped:  # tokens the others' shares left unused go to those held back by theirs
            self._admit(batch, skipped, budget, prefill, None, used)
        self.shares.settle(allowance, used, capacity, carry=not cfg.chunked_prefill)
        return batch

    def quiet_ready(self) -> bool:
        """Whether the next step may be a quiet one (tenancy.step_caps' `quiet_fits`)."""
        return self.config.tenant_quiet_prefill and self._quiet >= 1

    def _decode_lane(self, plan: StepPlan) -> bool:
        """Whether this step is a decode lane's: max_prefill_with_decode=0 and some sequence the step
        runs is decoding, unless `decode_burst` such steps ran in a row while prompts waited (this
        step then takes prompt tokens). Counts the run."""
        cfg = self.config
        if cfg.max_prefill_with_decode != 0 or not cfg.chunked_prefill:
            self._lane_steps = 0
            return False
        active = [s for s in self.running if s.request_id not in plan.pause]
        if not any(s.num_computed_tokens >= s.prompt_len for s in active):
            self._lane_steps = 0
            return False
        waiting = bool(self.waiting) or any(s.num_computed_tokens < s.prompt_len for s in active)
        if not waiting:  # nothing to delay: the run does not count
            self._lane_steps = 0
            return True
        if self._lane_steps >= cfg.decode_burst:
            self._lane_steps = 0
            return False
        self._lane_steps += 1
        return True

    def _admit(self, batch: ScheduledBatch, candidates: list[Sequence], budget: int, prefill: int,
               allowance: dict | None, used: Counter) -> tuple[int, int, list[Sequence]]:
        """Admits candidates in order while the step has tokens, slots and blocks; with `allowance`,
        each within its tenant's share. Returns the budget and prompt tokens left, and the candidates
        held back by their tenant's share alone."""
        cfg, bm = self.config, self.block_manager
        tenants = Counter(seq.tenant for seq in self.running)
        skipped, held = [], set()  # held: tenants whose share is spent (their later candidates wait too)
        for seq in candidates:
            if min(budget, prefill) <= 0 or len(self.running) >= cfg.max_batch_size:
                break
            f = share_of(seq)
            if seq.tenant_max_running is not None and tenants[seq.tenant] >= seq.tenant_max_running:
                continue  # the tenant runs its most at once
            cached = bm.num_cached_tokens(seq)
            need = seq.num_tokens - cached
            n = min(need, budget, prefill)
            if not cfg.chunked_prefill and n < need:
                break
            if allowance is not None and (f in held or allowance.get(f, 0) < (n if not cfg.chunked_prefill else 1)):
                held.add(f)
                skipped.append(seq)
                continue
            if allowance is not None:
                n = min(n, allowance[f])
            if self._caps is not None and seq.tenant in self._caps:
                n = short_of_pictures(seq, cached, self._caps.allow(seq.tenant, n, True), self._caps.prompt_left(seq.tenant))
                if n <= 0 or (not cfg.chunked_prefill and n < need):
                    continue  # its tenant carries its part of this step already
            if not bm.can_allocate(seq, cached + n):
                break
            if seq.adapter is not None and not self.adapters.ready(seq.adapter):
                continue  # its adapter is being swapped in: the rest of the queue goes on
            bm.allocate(seq, cached + n)
            if seq.adapter is not None:
                self.adapters.acquire(seq.adapter)
            seq.status = SequenceStatus.RUNNING
            self._dequeue(seq)
            self.running.append(seq)
            tenants[seq.tenant] += 1
            batch.entries.append((seq, n))
            self._spend_cap(seq.tenant, n, True)
            budget -= n
            prefill -= n
            used[f] += n
            if allowance is not None:
                allowance[f] -= n
        return budget, prefill, skipped

    def _spend_cap(self, tenant, n: int, prompt: bool) -> None:
        if self._caps is not None:
            self._caps.spend(tenant, n, prompt)

    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, int]) -> list[Sequence]:
        """Advances the scheduled sequences; `sampled` maps seq_id -> next token for those whose
        step reached their last token. Returns the sequences that finished."""
        finished = []
        for seq, n in batch.entries:
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk: nothing sampled yet
            if seq.prefill_only:  # head mode: the runner has read the prompt's hidden states
                self._finish(seq, "head")
                finished.append(seq)
                continue
            token = sampled[seq.seq_id]
            seq.append(token)
            reason = None
            if token in seq.stop_token_ids:
                reason = "stop"
            elif seq.num_generated >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
                reason = "length"
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished
