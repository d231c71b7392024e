"""Fair shares of one step between tenants, and their connections' turns at admission (no torch here).

Each step the scheduler hands out its prompt tokens (prefill chunks and new prompts; decode tokens,
one per running sequence, are not shared out: they are few and each is a client's next token) by
deficit round robin over the tenants that want some (`share_of`): a tenant's share follows its
`tenant_weight`, and tokens a tenant does not want go round again to those that do, so the step
stays full (work-conserving). Within a tenant its share goes to its sequences in the policy's order,
whichever connection sent them: a tenant's camera chunks are finished whole, one after another.
Splitting a tenant's share evenly between its connections instead made every one of 32 cameras'
chunks take a slice of every step: each chunk then waited for the slowest (an H200 at 32 cameras went
from a 0.5 s p95 into a 3.7 s backlog it did not leave). With one tenant everything it can use is its
own: the scheduler then runs as it did before tenants.

A tenant whose turn cannot be used because its next prompt must run whole (chunked prefill off) and
does not fit keeps its unused tokens as credit (the "deficit") for the next step, up to one step's
worth, so a long prompt is not starved by a stream of short ones.

A *flow* is the pair (tenant, owner): a tenant's connection. Flows decide who is admitted first (a
flow with nothing running, `newcomers_first`) and whose sequence makes room (`busiest_flow`).

Two more guards keep a flooding tenant from slowing another's requests:

- **room** (`busiest_flow`): a flow with nothing running gets a slot of a full batch and the KV blocks
  of its first chunk by preempting (recompute) the busiest flow's latest sequence. Without the
  blocks, a victim behind 200-token decodes that had taken every block waited until the flood's
  own growth preempted one of them: up to 13 steps in a simulation of the soak's `long` flood.
- **step cap** (`step_caps`): while several tenants have work, a tenant holding more sequences than
  its weight's share of them carries at most its weight's part of the largest per-weight demand of
  the tenants within their share (at least one token), decode tokens included. A victim's decode
  step then carries one flood token, not seven: on CPU a step costs about its tokens, and seven
  flood decodes doubled the victim's decode step of the tiny model. The cost is the flooding
  tenant's own throughput while another tenant has work; a tenant alone is never capped. It also runs at
  most as many sequences as they hold per weight, or one per SEQ_TOKENS of their tokens if more (`seq_cap`): a
  step's cost follows its sequences too. A capped
  prompt chunk also stops before a picture it would begin to encode and cannot take whole
  (`short_of_pictures`): the tower's cost is the picture's, not the chunk's.
"""

from __future__ import annotations

from collections import Counter

from .sequence import Sequence

Flow = tuple  # (tenant, owner)


def flow_of(seq: Sequence) -> Flow:
    return (seq.tenant, seq.owner)


def share_of(seq: Sequence):
    """Whose share of a step's prompt tokens a sequence's tokens come from: its tenant's."""
    return seq.tenant


def tenant_turns(seqs: list[Sequence], running: list[Sequence]) -> list[Sequence]:
    """`seqs` with their tenants taking turns: round by round one of each tenant's, in the order they had,
    and within a round the tenant running the fewest sequences for its weight first (then the one met
    first). With one tenant the order stays as it is. A flood's idle connections are newcomers as much as
    a victim's one: in their plain order (the policy's, by arrival) the flood's 27 came before the victim's,
    their chunks took the batch's last slots and the victim's request waited a step, every 13th one under
    the soak's `topup32` on an H200 (results/soak/nvidia_h200/passed_over)."""
    held: Counter = Counter()
    weight: dict = {}
    for seq in running:
        held[seq.tenant] += 1
        weight[seq.tenant] = seq.tenant_weight
    rank: Counter = Counter()
    first: dict = {}
    keyed = []
    for i, seq in enumerate(seqs):
        t = seq.tenant
        first.setdefault(t, i)
        keyed.append((rank[t], held[t] / weight.get(t, 1.0), first[t], i))
        rank[t] += 1
    if len(first) < 2:
        return list(seqs)
    return [seqs[k[3]] for k in sorted(keyed)]


def newcomers_first(candidates: list[Sequence], running: list[Sequence]) -> list[Sequence]:
    """The first candidate of each flow with nothing running, tenants taking turns (`tenant_turns`), then
    the rest in their order (with one flow the order stays as it is)."""
    holding = {flow_of(seq) for seq in running}
    first: dict = {}
    for seq in candidates:
        first.setdefault(flow_of(seq), seq)
    newcomers = [seq for f, seq in first.items() if f not in holding]
    if not newcomers:
        return candidates
    chosen = set(map(id, newcomers))
    return tenant_turns(newcomers, running) + [seq for seq in candidates if id(seq) not in chosen]


def water_fill(demands: dict, weights: dict, capacity: int, order: list) -> dict:
    """Integer tokens per flow: rounds in which every flow still wanting tokens gets its weighted
    share of what is left (at least 1), never more than it wants, until the capacity or the
    wants run out. `order` (the flows, rotated by the caller) breaks the ties of the last tokens."""
    give = {f: 0 for f in demands}
    wanting = [f for f in order if demands[f] > 0]
    left = capacity
    while left > 0 and wanting:
        total = sum(weights[f] for f in wanting)
        spent, still = 0, []
        for f in wanting:
            share = max(1, int(left * weights[f] / total))
            g = min(share, demands[f] - give[f], left - spent)
            give[f] += g
            spent += g
            if give[f] < demands[f]:
                still.append(f)
        left -= spent
        wanting = still
    return give


class FairShares:
    """The scheduler's per-tenant token shares (keyed by `share_of`), step after step."""

    def __init__(self) -> None:
        self.credit: dict = {}  # deficit carried to the next step (chunked prefill off only)
        self._turn = 0  # rotates which tenant gets the odd leftover token first
        self.demand: dict = {}  # this step's wants (read by settle)

    def allowances(self, running: list[Sequence], candidates: list[Sequence], capacity: int,
                   slots: int) -> dict:
        """Prompt tokens each tenant may use this step. running: the running sequences the step may
        run (their prompt chunks want tokens); candidates: the waiting sequences that may be
        admitted, in order (each tenant counts at most `slots` of them, and no more than the capacity)."""
        demand: dict = {}
        weights: dict = {}
        for seq in running:
            if seq.num_computed_tokens < seq.prompt_len:
                f = share_of(seq)
                demand[f] = demand.get(f, 0) + seq.num_remaining
                weights[f] = seq.tenant_weight
        counted: Counter = Counter()
        for seq in candidates:
            f = share_of(seq)
            if counted[f] >= slots or demand.get(f, 0) >= capacity:
                continue
            counted[f] += 1
            demand[f] = demand.get(f, 0) + seq.num_tokens - seq.num_computed_tokens
            weights.setdefault(f, seq.tenant_weight)
        self.demand = demand
        if not demand:
            self.credit.clear()
            return {}
        order = sorted(demand, key=repr)
        self._turn = (self._turn + 1) % len(order)
        order = order[self._turn:] + order[:self._turn]
        give = water_fill(demand, weights, capacity, order)
        return {f: give[f] + self.credit.get(f, 0) for f in demand}

    def settle(self, allowance: dict, used: dict, capacity: int, carry: bool) -> None:
        """After the step: a tenant that still wanted tokens keeps what it could not use as credit (only
        with `carry`: without chunked prefill, where a whole prompt must fit); others start afresh."""
        credit = {}
        if carry:
            for f, a in allowance.items():
                if used.get(f, 0) < self.demand.get(f, 0) and a > used.get(f, 0):
                    credit[f] = min(capacity, a - used.get(f, 0))
        self.credit = credit


def busiest_flow(holding: Counter, tenants: Counter, weight: dict, newcomer_tenant) -> Flow | None:
    """The flow to preempt for a newcomer of `newcomer_tenant`: the one whose tenant holds the most
    running sequences for its weight, then the one holding the most. None when taking from it is not
    fair: its last sequence, unless it is another tenant's, that tenant holds more than one and the
    newcomer's tenant holds none."""
    if not holding:
        return None
    busiest = max(holding, key=lambda g: (tenants[g[0]] / weight[g[0]], holding[g]))
    if holding[busiest] > 1 or (busiest[0] != newcomer_tenant and tenants[busiest[0]] > 1
                                and not tenants[newcomer_tenant]):
        return busiest
    return None


SEQ_TOKENS = 4  # step_caps' `seq_cap`: a capped tenant's sequence counts as this many of the others' tokens


class Caps(dict):
    """tenant -> tokens it may still carry this step (decode and prompt); `prompt`: tenant -> prompt
    tokens of them; `seqs`: tenant -> sequences it may still run in the step (None: no such cap)."""

    def __init__(self, total: dict, prompt: dict, quiet: bool = False, seqs: dict | None = None):
        super().__init__(total)
        self.prompt = prompt
        self.quiet = quiet  # the tenants over their share carry no prompt tokens (step_caps' `quiet_fits`)
        self.seqs = seqs

    def allow(self, tenant, n: int, prompt: bool) -> int:
        """`n` cut to what `tenant` may still carry (all of it when it is not capped)."""
        if tenant not in self:
            return n
        if self.seqs is not None and self.seqs[tenant] <= 0:
            return 0
        return min(n, self[tenant], self.prompt[tenant]) if prompt else min(n, self[tenant])

    def prompt_left(self, tenant) -> int:
        return min(self[tenant], self.prompt[tenant])

    def spend(self, tenant, n: int, prompt: bool) -> None:
        if tenant in self:
            self[tenant] -= n
            if prompt:
                self.prompt[tenant] -= n
            if self.seqs is not None and n > 0:
                self.seqs[tenant] -= 1


def step_caps(active: list[Sequence], candidates: list[Sequence], slots: int, stepped: dict | None = None,
              cached=None, quiet_fits: dict | None = None, seq_cap: bool = False) -> Caps | None:
    """Tokens each tenant over its share may carry this step; None when no one is capped.

    active: the running sequences the step may run; candidates: the waiting ones it may admit (a
    tenant counts at most `slots` of them, and no more than its running quota). A tenant's demand is
    a token per decoding sequence and the prompt tokens it still wants; it holds its running
    sequences and the candidates counted. Over its share: it holds more than its weight's part of
    all held. Its cap is its weight's part of the largest per-weight demand of the tenants within
    their share (at least one token), and of that at most their largest per-weight *prompt* demand
    in prompt tokens (possibly none): a prompt chunk turned another tenant's decode step into a
    prefill step, 3.9 against 1.3 ms for the tiny model's decode on CPU. stepped: id(sequence) ->
    tokens the step now running computes for it (the encode-ahead guess of the step after,
    serve/engine/lookahead.py). cached(sequence): the tokens of a waiting sequence's prompt the
    prefix cache holds (BlockManager.num_cached_tokens). A candidate wants only the tokens past them,
    as the scheduler admits it and as a capped tenant's chunks are charged. Counted whole, a victim's
    32-token prompt with 16 cached (a chat template and question shared with the flood, before a
    picture of its own) let the flood carry two prompts of 16 new tokens beside it, twice the victim's work.

    quiet_fits: tenant -> prompt tokens its share gives it this step. When the tenants within their share
    want prompt tokens and each one's fit in its share, the step is quiet: those over their share carry
    none (their decode tokens still run). Capped to the victim's own tokens, one flood prompt of 14 tokens
    still rode in each of a victim's 16-token prefills under the soak's `queue2048` on an H200: that step
    took 7.7-8.2 ms in the slowest tenth against 3.9-5.0 alone, the largest part of the flood's tail
    (results/soak/nvidia_h200/after_pacing). Only prompts their share finishes make it quiet, so backlogged
    tenants still share every step by weight; and the scheduler grants at most a share of the steps
    (SchedulerConfig.tenant_quiet_rate: a third by default), so the tenants over their share take prompt
    tokens in the rest whatever the others send.

    seq_cap: those over their share also run at most their weight's part of the largest per-weight count of
    sequences the tenants within their share hold, or of their level in SEQ_TOKENS (at least one). Tokens alone let
    a victim's 16-token prefill carry 16 of a `long` flood's decode tokens, one from each of up to 7 sequences: on 2
    CPU cores its first step then took 6.2 ms against 2.5 alone, in one process with no server
    (results/soak/cpu/seq_cap): each of those sequences cost about what four of the victim's tokens did."""
    demand, prompt, held, weight = Counter(), Counter(), Counter(), {}
    for seq in active:
        computed = seq.num_computed_tokens + (stepped.get(id(seq), 0) if stepped else 0)
        wanted = 1 if computed >= seq.prompt_len else seq.num_tokens - computed
        demand[seq.tenant] += wanted
        prompt[seq.tenant] += 0 if computed >= seq.prompt_len else wanted
        held[seq.tenant] += 1
        weight[seq.tenant] = seq.tenant_weight
    counted: Counter = Counter()
    for seq in candidates:
        cap = seq.tenant_max_running  # candidates past a tenant's running quota take no slot this step
        room = slots if cap is None else min(slots, cap - held[seq.tenant])
        if counted[seq.tenant] >= room:
            continue
        counted[seq.tenant] += 1
        wanted = seq.num_tokens - max(seq.num_computed_tokens, cached(seq) if cached is not None else 0)
        demand[seq.tenant] += wanted
        prompt[seq.tenant] += wanted
        weight.setdefault(seq.tenant, seq.tenant_weight)
    # a tenant's waiting sequences hold the slots they are about to take: a flood of one-token requests
    # holds no running sequence at any step's start (each finishes in the step that admits it), and
    # counted by its running ones alone it was never over its share; seven of its prefills then rode
    # in each of a victim's steps
    for tenant, n in counted.items():
        held[tenant] += n
    if len(demand) < 2:
        return None
    total_held, total_weight = sum(held.values()), sum(weight.values())
    over = {t for t in demand if held[t] > total_held * weight[t] / total_weight}
    within = [t for t in demand if t not in over and demand[t] > 0]
    if not over or not within:
        return None
    level = max(demand[t] / weight[t] for t in within)
    prompt_level = max(prompt[t] / weight[t] for t in within)
    wanting = [t for t in within if prompt[t] > 0]
    quiet = bool(quiet_fits and wanting) and all(prompt[t] <= quiet_fits.get(t, 0) for t in wanting)
    seqs = None
    if seq_cap:
        seq_level = max(max(held[t] / weight[t] for t in within), level / SEQ_TOKENS)
        seqs = {t: max(1, int(seq_level * weight[t])) for t in over}
    return Caps({t: max(1, int(level * weight[t])) for t in over},
                {t: 0 if quiet else int(prompt_level * weight[t]) for t in over}, quiet, seqs)


def short_of_pictures(seq: Sequence, start: int, n: int, cap: int) -> int:
    """`n` tokens of a capped tenant's prompt chunk from `start`, cut before a picture the chunk would
    begin to encode and that does not fit in `cap`: the tower encodes a whole picture whatever the
    chunk's size, so a one-token chunk reaching a flood's picture put that picture's encoding inside
    another tenant's decode step."""
    state = seq.state
    for item in state.vision:
        if item.offset >= start + n:
            break
        if item.offset >= start and item.num_tokens > cap and item.content_hash not in state.embeds:
            return item.offset - start
    return n
