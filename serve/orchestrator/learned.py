"""Step costs that learn from the engine's measured steps, starting from the offline profile.

The offline `CostProfile` is measured at engine start with synthetic steps (or assumed): it may
come from another GPU, it leaves out the engine's host work and the vision tower, and the
workload can shift under it. `LearnedCosts` keeps the profile's shape and fits how much each of
its parts costs on the steps actually served:

    step_ms = w0 + w1 * seqs + w2 * tokens / 1000  (host work the profile leaves out: scheduling,
                                                    inputs and sampling, per step, sequence, token)
            + w3 * base(seqs, seqs)                (the profile's decode-shaped base step)
            + w4 * (base(seqs, tokens) - base(seqs, seqs))   (its prefill tokens)
            + w5..w7 * lora[op](adapters, lora_tokens)       (atmm | delora | einsum, the one the step ran)
            + w8 * image_tokens / 1000             (the vision tower on the images this step prefills)

by least squares with exponential forgetting (`window` steps: older steps weigh less, so a shifted
workload or a warmed-up GPU is followed) and a ridge prior that pulls the weights toward
(0, 0, 0, 1, 1, 1, 1, 1, 0), the offline profile, worth `prior_steps` typical steps. The host terms
are corrections and may come out negative (a profile that overstates small steps); the profile's
parts and the vision tower cost time, so a fit that drives one below 0 is refit with it at 0. With no
observation the estimates are the profile's; a part never exercised (mixture never run) keeps
the profile's weight. Each observed step is predicted before it is learnt from, so `report()`
gives the honest (out-of-sample) error of the predictions the policy planned with.

On top of the fit, each step shape (its LoRA operator or none, decode or prefill, sequences and
tokens to the nearest power of two) keeps a factor that tracks the median of measured / fitted
for its steps (shrinking sign steps on the log ratio): what the linear parts cannot shape (a CUDA graph
bucket, a host cost that is not linear) is corrected where the engine has seen such steps, and
the median is what the error is judged by.

Switches are learnt apart (the planner times them): an exponentially weighted mean of the
measured ms per fold, starting at the profile's.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from operator import mul

from .nnls import nonnegative_solve
from .profile import LORA_OPS, CostProfile, batch_shape
from .types import Mode

FEATURES = ("host", "host_per_seq", "host_per_ktoken", "base_decode", "base_prefill",
            *(f"lora_{op}" for op in LORA_OPS), "image_ktokens")
PRIOR = (0.0, 0.0, 0.0, 1.0, 1.0, *(1.0 for _ in LORA_OPS), 0.0)
_BASE = 3  # index of base_decode; the profile's parts follow it
_LORA_AT = {op: _BASE + 2 + i for i, op in enumerate(LORA_OPS)}
_NONNEGATIVE = range(_BASE, len(FEATURES))
HUBER = 2.0  # residuals past this many times the running median |relative residual| are down-weighted
# a shape factor's log moves toward each of its measured steps by FIRST / sqrt(steps seen), never below
# MIN (it keeps following a drift): a 30% shape is learnt in a few tens of its steps, and a slow step
# once it has been seen a hundred times moves it by well under 1%
SHAPE_FIRST_STEP, SHAPE_MIN_STEP = 0.1, 0.004
CACHE_SIZE = 4096  # step shapes whose features (and current estimates) are kept


class LearnedCosts:
    """The profile's estimates, corrected by the measured steps. Offers the CostProfile methods
    the policies plan with (`step_ms`, `batch_ms`, `switch_cost_ms`, `switch_ms`), plus `observe`."""

    def __init__(self, profile: CostProfile, window: float = 500.0, prior_steps: float = 8.0,
                 log_size: int = 4096):
        if window < 1 or prior_steps <= 0:
            raise ValueError(f"learned costs: window must be >= 1 and prior_steps > 0, got {window}, {prior_steps}")
        self.profile = profile
        self.forget = 1.0 - 1.0 / window
        self.prior_steps = prior_steps
        n = len(FEATURES)
        self._xx = [[0.0] * n for _ in range(n)]  # forgetful sums of x x^T and x y
        self._xy = [0.0] * n
        self._scale = [1.0] * n  # forgetful mean |x_i|: the prior is worth prior_steps steps of this size
        # parts never seen non-zero (an operator the policy never runs): their rows and columns of
        # x x^T stay exactly 0, so the solver takes each as its own equation (nnls.nonnegative_solve)
        self._unseen = set(range(n))
        self.weights = list(PRIOR)
        self.switch_ms = dict(profile.switch_ms)  # op -> learnt ms of one fold
        self.observed = 0
        self._spread = 0.25  # running median |relative residual|: the scale the Huber weights use
        self._shape_log: dict[tuple, float] = {}  # step shape -> log of its measured / fitted factor
        self._shape_seen: dict[tuple, int] = {}
        self.errors: deque[float] = deque(maxlen=log_size)  # |predicted - measured| / measured, recent steps
        self.log: deque[tuple[str, int, int, float, float]] = deque(maxlen=log_size)  # (mode, seqs, tokens, pred, meas)
        # the policy prices several plans per step on the engine's step loop (the host, in series with
        # the GPU), mostly the same few step shapes: a shape's features (the profile's interpolations)
        # never change, and its estimate only when a step is learnt from, so both are kept
        self._features: dict[tuple, list[float]] = {}
        self._estimates: dict[tuple, float] = {}

    # ---- estimates (CostProfile's interface) -------------------------------------------------
    def features(self, seqs: int, tokens: int, lora_tokens: int = 0, lora_adapters: int = 0,
                 lora_op: str = "atmm", image_tokens: int = 0) -> list[float]:
        """The step's features (shared: not to be changed by the caller)."""
        if lora_tokens <= 0:  # no LoRA work: the same features whichever operator and adapters are named
            lora_adapters, lora_op = 0, None
        key = (seqs, tokens, lora_tokens, lora_adapters, lora_op, image_tokens)
        x = self._features.get(key)
        if x is None:
            if len(self._features) >= CACHE_SIZE:
                self._features.clear()
            x = self._features[key] = self._features_of(seqs, tokens, lora_tokens, lora_adapters, lora_op,
                                                        image_tokens)
        return x

    def _features_of(self, seqs: int, tokens: int, lora_tokens: int, lora_adapters: int, lora_op: str,
                     image_tokens: int) -> list[float]:
        p, x = self.profile, [0.0] * len(FEATURES)
        if seqs <= 0:
            return x
        tokens = max(tokens, seqs)
        decode = p.base(seqs, seqs)
        x[0], x[1], x[2] = 1.0, float(seqs), tokens / 1000.0
        x[_BASE], x[_BASE + 1] = decode, max(0.0, p.base(seqs, tokens) - decode)
        if lora_tokens > 0:
            x[_LORA_AT[lora_op]] = p.lora_ms(lora_op, lora_adapters, lora_tokens)
        x[-1] = image_tokens / 1000.0
        return x

    def predict(self, x: list[float]) -> float:
        return max(0.0, sum(map(mul, self.weights, x)))  # (the same sum, in the same order, as a generator's)

    @staticmethod
    def shape(seqs: int, tokens: int, lora_tokens: int, lora_op: str) -> tuple:
        tokens = max(tokens, seqs)
        return (lora_op if lora_tokens > 0 else None, tokens == seqs, seqs.bit_length(), tokens.bit_length())

    def step_ms(self, seqs: int, tokens: int, lora_tokens: int = 0, lora_adapters: int = 0,
                lora_op: str = "atmm", image_tokens: int = 0) -> float:
        if seqs <= 0:
            return 0.0
        if lora_tokens <= 0:  # (merge(a) and mixture(a) of a's requests alone: one estimate, as one shape)
            lora_adapters, lora_op = 0, None
        key = (seqs, tokens, lora_tokens, lora_adapters, lora_op, image_tokens)
        ms = self._estimates.get(key)
        if ms is None:
            fitted = self.predict(self.features(seqs, tokens, lora_tokens, lora_adapters, lora_op, image_tokens))
            factor = self._shape_log.get(self.shape(seqs, tokens, lora_tokens, lora_op))
            ms = fitted if factor is None else fitted * math.exp(factor)
            if len(self._estimates) >= CACHE_SIZE:
                self._estimates.clear()
            self._estimates[key] = ms
        return ms

    def batch_shape(self, mode: Mode, batch: Sequence[tuple[str | None, int]], lora_op: str = "atmm"):
        """(seqs, tokens, lora_tokens, adapters, op) of `batch` = [(adapter, tokens)] in `mode`
        (the same counting as CostProfile.batch_ms)."""
        return batch_shape(mode, batch, lora_op)

    def batch_ms(self, mode: Mode, batch: Sequence[tuple[str | None, int]], lora_op: str = "atmm",
                 image_tokens: int = 0) -> float:
        if not batch:
            return 0.0
        return self.step_ms(*self.batch_shape(mode, batch, lora_op), image_tokens=image_tokens)

    def switch_cost_ms(self, op: str, src: str | None, dst: str | None) -> float:
        if src == dst:
            return 0.0
        if op not in self.switch_ms:
            raise KeyError(f"profile {self.profile.name!r} has no switch op {op!r}; it has {sorted(self.switch_ms)}")
        return self.switch_ms[op] * ((src is not None) + (dst is not None))

    # ---- learning ------------------------------------------------------------------------------
    def observe(self, mode: Mode, batch: Sequence[tuple[str | None, int]], measured_ms: float,
                lora_op: str = "atmm", image_tokens: int = 0) -> float:
        """One served step: `batch` = [(adapter, tokens)] ran in `mode` in `measured_ms`. Returns
        the prediction made before learning from it."""
        if not batch or not measured_ms >= 0 or measured_ms == float("inf"):
            return float("nan")  # an empty or unmeasurable step teaches nothing
        self._estimates.clear()  # the weights and this shape's factor change below
        seqs, tokens, lora_tokens, adapters, op = self.batch_shape(mode, batch, lora_op)
        x = self.features(seqs, tokens, lora_tokens, adapters, op, image_tokens)
        fitted = self.predict(x)
        key = self.shape(seqs, tokens, lora_tokens, op)
        factor = self._shape_log.get(key, 0.0)
        predicted = fitted * math.exp(factor)
        if measured_ms > 0:
            self.errors.append(abs(predicted - measured_ms) / measured_ms)
            if fitted > 0:
                # a sign step, shrinking as the shape is seen more (stochastic approximation of the median)
                seen = self._shape_seen.get(key, 0) + 1
                self._shape_seen[key] = seen
                step = max(SHAPE_MIN_STEP, SHAPE_FIRST_STEP / math.sqrt(seen))
                gap = math.log(measured_ms / fitted) - factor
                self._shape_log[key] = factor + (min(step, gap) if gap > 0 else max(-step, gap))
        self.log.append((str(mode), seqs, tokens, predicted, measured_ms))  # (batch_shape's count and sum)
        # Huber weights: a step far off the fit (another process on the host, a page fault) counts
        # less, so the fit follows the typical step (the median) rather than the tail's mean
        rel = abs(measured_ms - fitted) / max(fitted, 1e-3)
        self._spread *= math.exp(0.05 if rel > self._spread else -0.05)  # tracks the median |residual|
        limit = HUBER * max(self._spread, 0.02)
        weight = 1.0 if rel <= limit else limit / rel
        lam = self.forget
        if self.observed:
            keep = 1 - lam
            self._scale = [lam * s + keep * abs(v) for s, v in zip(self._scale, x)]
        else:
            self._scale = [max(abs(v), 1e-3) for v in x]
        wx = [weight * v for v in x]
        self._xy = [lam * s + xi * measured_ms for s, xi in zip(self._xy, wx)]
        if self._unseen:
            self._unseen = {i for i in self._unseen if not x[i]}
        # (a part still never seen keeps its row at +0.0, as lam * 0.0 + 0.0 * v leaves it: not recomputed)
        unseen = self._unseen
        self._xx = [row if i in unseen else [lam * r + xi * v for r, v in zip(row, x)]
                    for i, (row, xi) in enumerate(zip(self._xx, wx))]
        self.observed += 1
        self._refit()
        return predicted

    def _refit(self) -> None:
        n = len(FEATURES)
        ridge = [self.prior_steps * max(s, 1e-3) ** 2 for s in self._scale]
        xx = self._xx
        b = [self._xy[i] + ridge[i] * PRIOR[i] for i in range(n)]
        # (the solver does the plain active-set elimination's arithmetic, less the work never read: nnls.py)
        self.weights = nonnegative_solve(xx, ridge, b, _NONNEGATIVE, self._unseen)

    def observe_switch(self, op: str, folds: int, measured_ms: float, share: float = 0.2) -> None:
        """A switch of `folds` folds (merge a->b: 2) measured at `measured_ms`."""
        if folds > 0 and measured_ms >= 0 and op in self.switch_ms:
            self.switch_ms[op] += share * (measured_ms / folds - self.switch_ms[op])

    def report(self) -> dict:
        errors = list(self.errors)
        return {"observed": self.observed,
                "median_abs_rel_err": statistics.median(errors) if errors else None,
                "within_15pct": sum(e <= 0.15 for e in errors) / len(errors) if errors else None,
                "weights": dict(zip(FEATURES, (round(w, 4) for w in self.weights))),
                "switch_ms": dict(self.switch_ms),
                "recent": [dict(mode=m, seqs=s, tokens=t, predicted_ms=round(p, 3), measured_ms=round(y, 3))
                           for m, s, t, p, y in list(self.log)[-8:]],
                # the steps that took longest against their prediction (a stall, a kernel compiled on
                # first use, a mode dearer than profiled): what a replay far off its peers is read by
                "slowest": [dict(mode=m, seqs=s, tokens=t, predicted_ms=round(p, 3), measured_ms=round(y, 3))
                            for m, s, t, p, y in sorted(self.log, key=lambda e: e[4] - e[3])[-4:][::-1]]}
