"""V-LoRA's credit-based scheduling policy (paper section 4.4.3): decisions from the cost model, or
Algorithm 1 as printed.

Both share the credits below (who starves). `decide="cost"` (conf/orchestrator/v_lora.yaml) then
prices, from the cost model, each candidate plan and takes the cheapest per token served:

- unmerge: everyone admitted (the starving first, then arrival order), every adapter through ATMM;
- mixture(a), for a the current merged adapter and the most requested one: everyone admitted,
  the other adapters' tokens through deLoRA (one LoRA call, serve/lora/modes.py); merge(a) when
  the batch turns out to hold only a;
- hold(a): only a's requests admitted (the starving too, so only when no request of another
  adapter starves); requests of other adapters already running finish in mixture(a), then the
  steps run merged with no LoRA work at all. Its estimate weighs the two by the steps each
  lasts. Holding pays where a's requests alone fill the batch and the LoRA branch is a large
  share of a step, and never past a held request's starving threshold, which makes the plan
  infeasible.

`price="step"` (the default) prices the step the engine will actually run for the plan, prefill
chunks and their images included, with the decode steps its batch goes on with and the switch
spread over the expected dwell (serve/orchestrator/pricing.py). `price="decode"` is the earlier
rule: (decode step of the plan's batch + switch_ms / horizon) / sequences in the batch, horizon the
mean remaining output tokens; it misprices prefill-heavy work (video frames, head requests),
where unmerge's LoRA cost lies in the prefill tokens. Ties keep the current weights. The
anti-thrash dwell below applies to both ways of deciding.

The cost model learns (`learn`, serve/orchestrator/learned.py): every served step the engine
measured (planner.observe_step -> `observe`) refits the profile's parts to the measured times, so
the prices are the serving GPU's and the current workload's, and the decisions' predicted and
measured step costs are in `stats.learning` and the decision log. A guard (`guard`,
serve/orchestrator/guard.py) holds the measured cost of the steps served against what the fixed
modes (unmerge; the most requested adapter merged) are predicted to cost for the same batches,
and falls back to the better fixed mode for a while when the policy loses by over `guard_margin`.

`decide="algorithm1"` (conf/orchestrator/v_lora_paper.yaml, for the paper's reproduction):

Every waiting request carries a credit: its waiting time, plus its estimated execution time
in the current mode (from the cost profile), plus the switch latency it would need if the
current mode cannot run it. It starves when

    priority * credit > tolerance * slo_ms            (slo_ms: its application's latency target)

Then, over the requests in the system R (waiting and running), with R_merge those of the most
requested adapter and R_starve the starving ones:

- |R_starve| <= starve_share * MaxBS and |R_merge| > merge_share * D  (D: see `share_of`):
  - nobody starves -> merge(a): admit R_merge, first come first served;
  - some starve    -> mixture(a): admit R_starve (most overdue first), then R_merge;
- otherwise -> unmerge: admit R_starve, then everyone else first come first served.

What Algorithm 1 leaves to the implementation, and what we added after measuring it:
- running requests of other adapters keep running across a switch to merge(a): the policy then
  picks mixture(a) (same weights, so free to leave later) until they finish, rather than pausing
  them;
- `backfill` (off in Algorithm 1, on in conf/orchestrator/v_lora.yaml): requests of other
  adapters are admitted with the merged adapter's, in arrival order, rather than held until they
  starve. Holding them is what buys merge mode its batch, and it pays only where the LoRA branch
  is a large share of a step; measured on an H200 with our kernels it is about 16% of a decode
  step, and holding 40% of the requests up to their starving threshold cost far more latency
  than merging saved (results/serving/nvidia_h200/README.md);
- `mixture_by_cost`: before taking mixture(a) the policy compares, from the cost profile, the
  decode step of the batch it would run (the running requests plus those it admits) in
  mixture(a) and in unmerge, each with the switches it needs spread over the steps the requests
  of other adapters still have to run; when unmerge is cheaper it unmerges (the starving first).
  At decode, where the LoRA branch is bound by reading adapter weights rather than by tokens,
  mixture reads about as many bytes as unmerge (the other adapters' plus the merged one's), so
  it rarely wins there; in prefill it does;
- anti-thrash: a switch costing s ms is followed by a dwell of s * (1 - max_switch_share) /
  max_switch_share ms in which the weights stay (the policy holds mixture(current) or unmerge,
  which can run every request, so the starving are still admitted first). That bounds the
  share of time spent switching by `max_switch_share` whatever the workload does; with the
  one-shot kernel (~1-5 ms) and 10% it is 10-45 ms, a few decode steps. The adapter already
  merged also keeps its place while its share stays above merge_share - share_hysteresis.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .base import BatchEstimate, Policy, fcfs
from .adaptive import Adaptive
from .pricing import decode_hold_price, decode_plan_price, hold_price, plan_price
from .profile import CostProfile
from .types import Decision, Mode, RequestView, StepView

SHARE_OF = ("max_batch", "present")
DECIDE = ("cost", "algorithm1")
PRICE = ("step", "decode")
# A request's starving threshold (tolerance * slo_ms / priority) is divided by; a target that rounds
# to 0.0 (slo_ms=5e-324: 0.5 * 5e-324 == 0.0), or any target below one step's time, means "starving
# at once", not a division by zero. One microsecond is below any step, so such a request is simply
# the most overdue one, as its target says.
MIN_THRESHOLD_MS = 1e-3


@dataclass
class VLoRAConfig:
    decide: str = "cost"  # "cost": cheapest plan per token from the profile | "algorithm1": the paper's rule
    tolerance: float = 0.5  # starving once priority * credit exceeds this share of the target
    default_slo_ms: float = 5000.0  # target of a request that carries none
    merge_share: float = 0.5  # R_merge must exceed this share of D to merge
    share_of: str = "max_batch"  # D: "max_batch" (the paper: MaxBS) | "present" (min(MaxBS, |R|))
    starve_share: float = 0.5  # more starving than this share of MaxBS -> unmerge
    share_hysteresis: float = 0.1  # the merged adapter stays while its share > merge_share - this
    max_switch_share: float = 0.1  # at most this share of wall time goes to switching (dwell)
    # not in Algorithm 1: admit other adapters' requests after the merged adapter's instead of holding
    # them until they starve; merge then happens only when the batch is the top adapter's alone
    backfill: bool = False
    mixture_by_cost: bool = True  # take mixture only when the profile says it is cheaper than unmerge
    lora_op: str = "atmm"
    switch_op: str = "atmm"
    price: str = "step"  # "step": the whole step the plan runs (prefill, images) | "decode": its decode step
    learn: bool = True  # refit the cost model to the engine's measured steps while serving
    learn_window: float = 500.0  # steps: older measured steps weigh less (forgetting), the workload may shift
    guard: bool = True  # fall back to the better fixed mode while the policy is measured losing to it
    guard_window: int = 128  # steps compared before the guard judges
    guard_margin: float = 0.05  # losing by more than this share engages the fallback
    guard_hold_steps: int = 256  # steps of the first fallback (doubled each time it re-engages soon after)

    def __post_init__(self) -> None:
        if self.decide not in DECIDE:
            raise ValueError(f"decide {self.decide!r} is not one of {DECIDE}")
        if self.price not in PRICE:
            raise ValueError(f"price {self.price!r} is not one of {PRICE}")
        if self.share_of not in SHARE_OF:
            raise ValueError(f"share_of {self.share_of!r} is not one of {SHARE_OF}")
        for name in ("tolerance", "merge_share", "starve_share", "max_switch_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must lie in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.share_hysteresis < self.merge_share:
            raise ValueError(f"share_hysteresis must lie in [0, merge_share), got {self.share_hysteresis}")


class VLoRAPolicy(Adaptive, Policy):
    name = "v_lora"

    def __init__(self, profile: CostProfile, config: VLoRAConfig | None = None, log_size: int = 1000):
        super().__init__(profile, log_size)
        self.config = config or VLoRAConfig()
        self.lora_op, self.switch_op = self.config.lora_op, self.config.switch_op
        self._fresh_state()

    # ---- credits ------------------------------------------------------------------------------
    def threshold_ms(self, r: RequestView) -> float:
        """Credit above which `r` starves; never below MIN_THRESHOLD_MS (see there)."""
        slo = r.slo_ms if r.slo_ms is not None else self.config.default_slo_ms
        threshold = self.config.tolerance * slo / r.priority  # priority > 0: RequestView checks it
        # `not >=` also catches NaN; +inf (a huge target over a tiny priority) is fine: never starving
        return threshold if threshold >= MIN_THRESHOLD_MS else MIN_THRESHOLD_MS

    def credits(self, view: StepView) -> dict[str, float]:
        """request id -> credit (ms) of every waiting request."""
        mode, p = view.mode, self.costs
        here = BatchEstimate(p, mode, self.lora_op, view.running)
        away = None  # requests the current mode cannot run: estimated in unmerge, after the switch
        switch_ms = p.switch_cost_ms(self.switch_op, mode.merged_adapter, None)
        out, left = {}, {}  # left: the estimate by what it reads, once each (a flood's requests are alike)
        for r in view.waiting:
            key = (r.adapter, r.output_mode, r.remaining_prompt, r.remaining_output)
            ms = left.get(key)
            if ms is None:
                if mode.can_run(r.adapter):
                    ms = here.exec_ms(r)
                else:
                    away = away or BatchEstimate(p, Mode.unmerge(), self.lora_op, view.running)
                    ms = away.exec_ms(r) + switch_ms
                left[key] = ms
            out[r.request_id] = view.now_ms - r.arrival_ms + ms
        return out

    def dwell_ms(self) -> float:
        share = self.config.max_switch_share
        return self.costs.switch_ms.get(self.switch_op, 0.0) * (1 - share) / share

    def _mixture_vs_unmerge(self, view: StepView, top: str, admit: list[RequestView]) -> str | None:
        """None when mixture(top) is the cheaper way to run `view.running` + `admit`; else why not.
        Compared on their decode step (one token each): a mode holds for many steps, most of them
        decode steps, and judging by this step's prefill chunk would flip the weights back and forth."""
        batch = [(r.adapter, 1) for r in (*view.running, *admit)]
        others = [r for r in (*view.running, *admit) if r.adapter != top]
        # steps the mixed batch lasts; at least one (a switch is divided by it)
        horizon = max(1, max((r.remaining_output for r in others), default=1))
        p, cur = self.costs, view.mode.merged_adapter
        mix = p.batch_ms(Mode.mixture(top), batch, self.lora_op) + p.switch_cost_ms(self.switch_op, cur, top) / horizon
        # unmerging now costs a switch, and merging `top` again once the others are gone another
        back = 2 if cur == top else 0
        unm = (p.batch_ms(Mode.unmerge(), batch, self.lora_op)
               + back * p.switch_cost_ms(self.switch_op, top, None) / horizon)
        if mix <= unm:
            return None
        return f"mixture {mix:.2f} ms > unmerge {unm:.2f} ms per step (profile)"

    def starving(self, view: StepView) -> list[RequestView]:
        """Waiting requests over their threshold, the most overdue first."""
        if not view.waiting:  # (most steps below capacity: no credit to estimate)
            return []
        credits = self.credits(view)
        urgency = {r.request_id: credits[r.request_id] / self.threshold_ms(r) for r in view.waiting}
        return sorted((r for r in view.waiting if urgency[r.request_id] > 1),
                      key=lambda r: (-urgency[r.request_id], r.arrival_ms, r.request_id))

    @staticmethod
    def _everyone(view: StepView, starving: list[RequestView]) -> list[RequestView]:
        """Every waiting request in the order a mode that runs everyone admits them: the starving
        (most overdue first), then the rest in arrival order."""
        ids = {r.request_id for r in starving}
        return starving + fcfs(r for r in view.waiting if r.request_id not in ids)

    def _top(self, present: list[RequestView], cur: str | None) -> tuple[Counter, str | None]:
        """Requests per adapter and the most requested adapter (ties: the merged one, then the one whose
        request fcfs order puts first)."""
        # first: each adapter's first request in fcfs order, (arrival, id): equal arrivals (a trace's
        # burst) are ordered by id as fcfs orders them, never by the adapter's name
        counts, first = Counter(), {}
        for r in present:
            a = r.adapter
            if a is not None:
                counts[a] += 1
                key = (r.arrival_ms, r.request_id)
                if a not in first or key < first[a]:
                    first[a] = key
        top = min(counts, key=lambda a: (-counts[a], a != cur, first[a], a)) if counts else None
        return counts, top

    def _decide(self, view: StepView) -> Decision:
        if not view.waiting and not view.running:
            return Decision(view.mode, reason="idle")
        starving = self.starving(view)
        if self.config.decide == "cost":
            target, admit, reason = self._by_cost(view, starving)
        else:
            target, admit, reason = self._algorithm1(view, starving)
        if self.guard is not None and self.guard.active is not None:
            target, admit, reason = self._fallback(view, starving, self.guard.active, reason)
        return self._dwell(view, target, admit, reason, starving)

    # ---- decisions from the cost model -----------------------------------------------------------
    def plan_cost(self, view: StepView, mode: Mode, admit: list[RequestView], merged_only: bool = False) -> float:
        """Predicted ms per token of running `mode` with the running requests plus `admit` (as many as
        fit): the whole step and the decode steps after it (price="step", serve/orchestrator/pricing.py),
        or the decode step alone per sequence (price="decode"); a switch from the current weights
        spread over the steps the mode is expected to stay. merged_only: the batch once other
        adapters' running requests have finished."""
        if self.config.price == "decode":
            return decode_plan_price(self.costs, view, mode, admit, self.lora_op, self.switch_op, merged_only)
        return plan_price(self.costs, view, mode, admit, self.lora_op, self.switch_op, self._dwell_steps, merged_only,
                          self._price_cache)

    def hold_cost(self, view: StepView, a: str, mine: list[RequestView]) -> float:
        """hold(a): other adapters' running requests finish in mixture(a) (their remaining steps),
        then a's requests run merged; the two per-token costs weighted by their share of the
        steps the batch lasts."""
        if self.config.price == "decode":
            return decode_hold_price(self.costs, view, a, mine, self.lora_op, self.switch_op)
        return hold_price(self.costs, view, a, mine, self.lora_op, self.switch_op, self._dwell_steps,
                          self._price_cache)

    def _by_cost(self, view: StepView, starving: list[RequestView]) -> tuple[Mode, list[RequestView], str]:
        cur = view.mode.merged_adapter
        present = [*view.waiting, *view.running]
        counts, top = self._top(present, cur)
        everyone = self._everyone(view, starving)
        plans = [(Mode.unmerge(), everyone, "unmerge", self.plan_cost(view, Mode.unmerge(), everyone))]
        for a in dict.fromkeys(x for x in (cur, top) if x is not None):
            mixed = self.plan_cost(view, Mode.mixture(a), everyone)
            plans.append((Mode.mixture(a), everyone, f"mixture({a})", mixed))
            if all(r.adapter == a for r in starving):  # holding others is allowed until one starves
                mine = [r for r in everyone if r.adapter == a]
                # every request is a's: holding admits the same batch as mixture(a), at its price
                alone = len(mine) == len(everyone) and all(r.adapter == a for r in view.running)
                plans.append((Mode.mixture(a), mine, f"hold({a})", mixed if alone else self.hold_cost(view, a, mine)))
        costs = [(cost, m.merged_adapter != cur, i) for i, (m, _, _, cost) in enumerate(plans)]
        best = min(costs)
        mode, admit, label, _ = plans[best[2]]
        batch = [*view.running, *admit[:view.free_slots]]
        if mode.kind == "mixture" and all(r.adapter == mode.adapter for r in batch):
            mode = Mode.merge(mode.adapter)  # the same weights; nobody else runs
        listed = ", ".join(f"{plans[i][2]} {c:.3f}" for c, _, i in sorted(costs) if c < float("inf"))
        share = f"{top} holds {counts[top]}/{len(present)}" if top else "no adapter requests"
        return mode, admit, f"{label}: cheapest per token ({listed} ms), {share}, {len(starving)} starving"

    # ---- Algorithm 1 ------------------------------------------------------------------------
    def _algorithm1(self, view: StepView, starving: list[RequestView]) -> tuple[Mode, list[RequestView], str]:
        cfg, mode = self.config, view.mode
        starving_ids = {r.request_id for r in starving}

        present = view.waiting + view.running
        cur = mode.merged_adapter
        counts, top = self._top(list(present), cur)
        denom = view.max_batch_size if cfg.share_of == "max_batch" else min(view.max_batch_size, len(present))
        need = (cfg.merge_share - (cfg.share_hysteresis if top == cur else 0.0)) * denom
        dominated = top is not None and counts[top] > need
        few_starving = len(starving) <= cfg.starve_share * view.max_batch_size
        n_starve = len(starving)
        share = f"{top} holds {counts[top] if top else 0}/{denom}" if top else "no adapter requests"

        # every mode that runs everyone (unmerge, backfilled mixture, a dwell) admits in this order
        everyone = self._everyone(view, starving)
        if dominated and few_starving:
            if cfg.backfill:  # nobody is held back: everyone in arrival order, the others through deLoRA
                admit = everyone
            else:
                admit = starving + fcfs(r for r in view.waiting if r.adapter == top and r.request_id not in starving_ids)
            others_running = sum(r.adapter != top for r in view.running)
            batch = admit[:view.free_slots]
            others_admitted = sum(r.adapter != top for r in batch)
            if others_admitted and not starving:
                target = Mode.mixture(top)
                reason = f"mixture: {share}, none starving, {others_admitted} of other adapters backfill"
            elif starving:
                target, reason = Mode.mixture(top), f"mixture: {share}, {n_starve} starving join through deLoRA"
            elif others_running:
                target = Mode.mixture(top)
                reason = f"mixture: {share}, none starving, {others_running} running of other adapters finish"
            else:
                target, reason = Mode.merge(top), f"merge: {share}, none starving"
            if target.kind == "mixture" and cfg.mixture_by_cost:
                cost = self._mixture_vs_unmerge(view, top, batch)
                if cost is not None:
                    target, reason, admit = Mode.unmerge(), f"unmerge: {share}, but {cost}", everyone
        else:
            admit = everyone
            why = f"not dominated ({share})" if few_starving else f"{n_starve} starving > {cfg.starve_share:g} MaxBS"
            target, reason = Mode.unmerge(), f"unmerge: {why}"
        return target, admit, reason

    def _dwell(self, view: StepView, target: Mode, admit: list[RequestView], reason: str,
               starving: list[RequestView]) -> Decision:
        cur = view.mode.merged_adapter
        since = view.now_ms - self.last_switch_ms
        if target.merged_adapter != cur and since < self.dwell_ms():
            # hold the weights; both hold modes run everyone, the starving first
            admit = self._everyone(view, starving)
            target = Mode.unmerge() if cur is None else Mode.mixture(cur)
            reason = f"dwell: {since:.0f} of {self.dwell_ms():.0f} ms since the last switch, hold {target} ({reason})"
        return Decision(target, tuple(r.request_id for r in admit[:view.free_slots]), (), False, reason,
                        len(starving))


@dataclass
class VLoRAPaperConfig(VLoRAConfig):
    """Algorithm 1 as the paper prints it: other adapters held until they starve, no profile veto."""

    decide: str = "algorithm1"
    backfill: bool = False
    mixture_by_cost: bool = False
    learn: bool = False  # the offline profile as it was measured
    guard: bool = False


class VLoRAPaperPolicy(VLoRAPolicy):
    name = "v_lora_paper"
