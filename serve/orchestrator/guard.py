"""A guard that keeps an adaptive policy from losing to a fixed mode on the steps it serves.

For every served step the guard is told what the step measured (plus the switch before it, if
any) and what the same batch is predicted to cost under each fixed mode:

    unmerge   every adapter's tokens through the unmerged operator, never a switch
    merge     the batch's most requested adapter merged (its tokens free of LoRA work), the rest
              through deLoRA (mixture), a switch whenever that adapter changes from one step to the next

Over a window of `window` steps it compares

    ratio(fixed) = (measured steps + measured switches) / (predicted(fixed) + residual),
    residual = measured steps - their predicted ms

(the residual hands each fixed mode the same model error and host time as the steps that ran, so
a model that misjudges every mode alike cannot trip the guard; what trips it is the policy's
choice of modes and its switches). When the best fixed mode beats the policy by more than `margin`
over a full window, the guard engages: for `hold_steps` steps the policy falls back to that mode's
plan. Then it lets the policy choose again (a trial over a fresh window); each engagement within
`cool_steps` steps of the last release doubles the next hold (up to `max_hold_steps`), so a
policy that keeps losing stays on the fixed mode longer and longer: the hysteresis.
"""

from __future__ import annotations

from collections import deque

FALLBACKS = ("unmerge", "merge")


class FixedModeGuard:
    def __init__(self, window: int = 128, margin: float = 0.05, hold_steps: int = 256,
                 max_hold_steps: int = 4096, cool_steps: int | None = None):
        if window < 1 or hold_steps < 1 or max_hold_steps < hold_steps or not 0 <= margin < 1:
            raise ValueError(f"guard: window and hold_steps must be >= 1, max_hold_steps >= hold_steps and margin "
                             f"in [0, 1); got {window}, {hold_steps}, {max_hold_steps}, {margin}")
        self.window, self.margin = window, margin
        self.base_hold, self.max_hold = hold_steps, max_hold_steps
        self.cool = cool_steps if cool_steps is not None else 4 * window
        # (measured step, measured switch, predicted step, unmerge, merge), in ms
        self._steps: deque[tuple[float, float, float, float, float]] = deque()
        self._sums = [0.0] * 5
        self.active: str | None = None  # the fixed mode fallen back to, or None
        self.left = 0  # steps of the current hold still to go
        self.hold = hold_steps
        self.steps = self.engaged = self.fallback_steps = 0
        self.engaged_to = dict.fromkeys(FALLBACKS, 0)  # engagements per fixed mode fallen back to
        self.released_at: int | None = None
        self.last_ratio: dict[str, float] = {}

    def ratios(self) -> dict[str, float]:
        """Measured over each fixed mode's prediction for the window's steps (> 1: the policy loses)."""
        measured, switches, predicted, unmerge, merge = self._sums
        residual = measured - predicted
        out = {}
        for name, fixed in zip(FALLBACKS, (unmerge, merge)):
            denom = fixed + residual
            out[name] = (measured + switches) / denom if denom > 0 else float("inf")
        return out

    def observe(self, measured_ms: float, switch_ms: float, predicted_ms: float, unmerge_ms: float,
                merge_ms: float) -> str | None:
        """One served step: its measured ms, the measured switch before it (0 if none), the model's
        prediction of the step, and the fixed modes' predicted ms for the same batch. Returns the
        fallback now in force (or None)."""
        self.steps += 1
        if self.active is not None:
            self.fallback_steps += 1
            self.left -= 1
            if self.left <= 0:  # a trial: the policy decides again, judged on a fresh window
                self.active, self.released_at = None, self.steps
                self._clear()
            return self.active
        row = (measured_ms, switch_ms, predicted_ms, unmerge_ms, merge_ms)
        self._steps.append(row)
        s = self._sums  # (each sum as the element-wise list sums made it, without their comprehensions)
        s = [s[0] + measured_ms, s[1] + switch_ms, s[2] + predicted_ms, s[3] + unmerge_ms, s[4] + merge_ms]
        if len(self._steps) > self.window:
            old = self._steps.popleft()
            s = [s[0] - old[0], s[1] - old[1], s[2] - old[2], s[3] - old[3], s[4] - old[4]]
        self._sums = s
        if len(self._steps) < self.window:
            return None
        ratio = self.last_ratio = self.ratios()
        best = "merge" if ratio["merge"] > ratio["unmerge"] else "unmerge"  # the cheapest fixed mode: the policy
        # loses most to it (max over FALLBACKS: unmerge on a tie)
        if self.last_ratio[best] > 1 + self.margin:
            soon = self.released_at is not None and self.steps - self.released_at <= self.cool
            self.hold = min(self.max_hold, 2 * self.hold) if soon else self.base_hold
            self.active, self.left = best, self.hold
            self.engaged += 1
            self.engaged_to[best] += 1
            self._clear()
        return self.active

    def _clear(self) -> None:
        self._steps.clear()
        self._sums = [0.0] * 5

    def report(self) -> dict:
        return {"active": self.active, "engaged": self.engaged, "engaged_to": dict(self.engaged_to),
                "fallback_steps": self.fallback_steps,
                "steps": self.steps, "hold_steps": self.hold,
                # None where a fixed mode was predicted to cost nothing (no finite ratio; JSON has no inf)
                "ratios": {k: round(v, 4) if v != float("inf") else None for k, v in self.last_ratio.items()}}
