"""What makes V-LoRA's policy adaptive: it learns its step costs from the engine's measured steps,
logs each decision's predicted and measured step cost, learns how long a mode stays between
switches (the dwell a switch is spread over), and falls back to a fixed mode while the guard says
it is losing to one. A mixin for VLoRAPolicy (serve/orchestrator/policy.py), which provides
`config` (learn, learn_window, guard, guard_window, guard_margin, guard_hold_steps), `_top` and
`_everyone`."""

from __future__ import annotations

import statistics
from collections import deque

from .guard import FixedModeGuard
from .learned import LearnedCosts
from .pricing import fixed_costs, fixed_top, planned_step
from .types import Decision, Mode, RequestView, StepView

DWELL_PRIOR_STEPS = 16.0  # steps a mode is expected to stay before any switch was seen
DWELL_SHARE = 0.2  # weight of the latest stint in the mean stint


class Adaptive:
    def _fresh_state(self) -> None:
        cfg = self.config
        # what the estimates come from: the offline profile, refit to measured steps when learning
        self.costs = LearnedCosts(self.profile, cfg.learn_window) if cfg.learn else self.profile
        self.guard = FixedModeGuard(cfg.guard_window, cfg.guard_margin, cfg.guard_hold_steps) if cfg.guard else None
        self._guard_top: str | None = None  # the adapter the guard's fixed merge mode holds merged
        self._stint, self._dwell_steps = 0, DWELL_PRIOR_STEPS  # steps since the last switch; their mean
        self._price_cache: dict | None = None
        self._planned = None  # the last decision's record, waiting for its step's measured time
        self._plan_errors: deque[float] = deque(maxlen=4096)
        self.stats.learning = self._learning_report if isinstance(self.costs, LearnedCosts) else None
        self.stats.guard = self.guard.report if self.guard is not None else None

    def _learning_report(self) -> dict:
        report = self.costs.report()
        errors = list(self._plan_errors)
        report["plan_median_abs_rel_err"] = statistics.median(errors) if errors else None
        return report

    def reset(self) -> None:
        super().reset()
        self._fresh_state()

    def decide(self, view: StepView) -> Decision:
        # the plans of one decision share their planned steps (by the ids they admit to the view's running
        # requests, so never kept past it), and the decision's own step is most often one of them
        cache = self._price_cache = {}
        try:
            d = super().decide(view)
        finally:
            self._price_cache = None
        if d.switch:
            self._dwell_steps += DWELL_SHARE * (max(1, self._stint) - self._dwell_steps)
            self._stint = 0
        self._stint += 1
        if d.reason == "idle":
            self._planned = None  # no step follows it
            return d
        step = None if d.pause else cache.get((d.admit, None))
        if step is None:
            waiting = {r.request_id: r for r in view.waiting}
            paused = set(d.pause)
            batch = [r for r in view.running if r.request_id not in paused] + [waiting[i] for i in d.admit]
            step = planned_step(view, batch)
        record = self.log[-1]
        record.predicted_ms = self.costs.batch_ms(d.mode, step.entries, self.lora_op, step.image_tokens)
        self._planned = record
        return d

    def observe(self, mode: Mode, batch: list[tuple[str | None, int]], measured_ms: float, image_tokens: int = 0,
                switch_ms: float = 0.0, switch_folds: int = 0) -> None:
        """One step the engine ran: `batch` = [(adapter, tokens)] in `mode`, measured `measured_ms`
        (host work included), after a switch of `switch_folds` folds measured `switch_ms` (0: none)."""
        if not batch:
            return
        costs, guard = self.costs, self.guard
        predicted = None
        if guard is not None and guard.active is not None:
            # a held fallback ignores the step's prices (FixedModeGuard.observe): only the adapter its
            # merge reference holds is followed, without pricing the step three times on the host
            unmerge = merge = 0.0
            top = fixed_top(batch, self._guard_top)
            self._guard_top = self._guard_top if top is None else top
        elif guard is not None:
            # priced with the model the policy decided with, before it learns from this step: a step
            # the model could not foresee (a stall, a mode dearer than profiled) then misses every
            # mode's price alike (the guard's residual) and is no loss of the policy's choosing. Priced
            # after, the model had learnt the surprise and the fixed modes looked cheaper by all of
            # it: one slow step engaged the fallback for hundreds of steps after the model knew better
            unmerge, merge, self._guard_top = fixed_costs(costs, mode, batch, self.lora_op, image_tokens,
                                                          self._guard_top, self.switch_op)
            if not isinstance(costs, LearnedCosts):
                predicted = costs.batch_ms(mode, batch, self.lora_op, image_tokens)
        if isinstance(costs, LearnedCosts):
            # its prediction before learning is the step's estimate the policy decided with
            before = costs.observe(mode, batch, measured_ms, self.lora_op, image_tokens)
            if guard is not None and guard.active is None:
                predicted = before if before == before else costs.batch_ms(mode, batch, self.lora_op, image_tokens)
            if switch_folds:
                costs.observe_switch(self.switch_op, switch_folds, switch_ms)
        record, self._planned = self._planned, None
        if record is not None:
            record.measured_ms = measured_ms
            if measured_ms > 0 and record.predicted_ms is not None:
                self._plan_errors.append(abs(record.predicted_ms - measured_ms) / measured_ms)
        if guard is not None:
            guard.observe(measured_ms, switch_ms, predicted or 0.0, unmerge, merge)

    def _fallback(self, view: StepView, starving: list[RequestView], kind: str,
                  reason: str) -> tuple[Mode, list[RequestView], str]:
        """The plan of fixed mode `kind`, as the guard priced it: everyone admitted (the starving
        first), "unmerge" unmerged, "merge" with the most requested adapter merged and the others
        through deLoRA (merge(a) when the batch is a's alone)."""
        everyone = self._everyone(view, starving)
        ratios = ", ".join(f"{k} {v:.3f}" for k, v in self.guard.last_ratio.items())
        why = f"guard: losing to fixed {kind} (measured / fixed {ratios})"
        if kind == "merge":
            _, top = self._top([*view.waiting, *view.running], view.mode.merged_adapter)
            if top is not None:
                batch = [*view.running, *everyone[:view.free_slots]]
                mode = Mode.merge(top) if all(r.adapter == top for r in batch) else Mode.mixture(top)
                return mode, everyone, f"{why}, {mode} ({reason})"
        return Mode.unmerge(), everyone, f"{why}, unmerge ({reason})"
