"""The cost profile the policies plan with: step time per mode and batch shape, switch time.

Measured at engine start (`measure_profile` times the engine's own step and switch callables)
and saved as JSON, so the orchestrator's estimates are the machine's, not constants:

    step_ms = base(seqs, tokens) + lora[op](adapters, lora_tokens)   (second term 0 without LoRA work)

`base` is a step with no LoRA work (merge mode, or base-model requests); `lora[op]` is the
extra time of the LoRA branch over the tokens that need it: "atmm" (unmerge through our
kernels), "einsum" (the dLoRA-style operator), "delora" (mixture: each such token computes
-dW_merged + dW_own; `adapters` counts the merged one). Grids are interpolated bilinearly,
clamped below the first point and extrapolated linearly past the last (prefill time keeps
growing with tokens). `switch_ms[op]` is one all-layer merge or unmerge: "atmm" (one-shot
kernel) or "addmm" (per-layer, dLoRA-style); merge(a) -> merge(b) costs two.
"""

from __future__ import annotations

import json
import statistics
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .types import Mode

LORA_OPS = ("atmm", "einsum", "delora")
SWITCH_OPS = ("atmm", "addmm")


def _interp1(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(bisect_right(xs, x) - 1, len(xs) - 2)  # segment [i, i+1]; past the end: the last one
    t = (x - xs[i]) / (xs[i + 1] - xs[i])
    return max(0.0, ys[i] + t * (ys[i + 1] - ys[i]))


@dataclass
class Grid2D:
    """values[i][j] at (rows[i], cols[j]), both axes strictly increasing."""

    rows: list[float]
    cols: list[float]
    values: list[list[float]]

    def __post_init__(self) -> None:
        for name, axis in (("rows", self.rows), ("cols", self.cols)):
            if not axis or any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError(f"Grid2D {name} must be non-empty and strictly increasing, got {axis}")
        if len(self.values) != len(self.rows) or any(len(v) != len(self.cols) for v in self.values):
            raise ValueError(f"Grid2D values must be [{len(self.rows)}][{len(self.cols)}] (rows x cols)")

    def __call__(self, row: float, col: float) -> float:
        rows = self.rows
        if len(rows) == 1 or row <= rows[0]:
            return _interp1(self.cols, self.values[0], col)
        # only the two rows around `row` enter the result (the policies price many steps per decision)
        i = min(bisect_right(rows, row) - 1, len(rows) - 2)
        pair = [_interp1(self.cols, self.values[k], col) for k in (i, i + 1)]
        return _interp1(rows[i:i + 2], pair, row)


def batch_shape(mode: Mode, batch: Sequence[tuple[str | None, int]], lora_op: str = "atmm") -> tuple:
    """(seqs, tokens, lora_tokens, adapters, op) of `batch` = [(adapter, tokens this step)] in `mode`: the
    tokens that go through a LoRA operator and over how many adapters (mixture runs deLoRA through ATMM,
    its merged adapter among them)."""
    tokens, lora_tokens, adapters = 0, 0, set()
    unmerged, merged = mode.kind == "unmerge", mode.adapter
    for adapter, n in batch:  # (priced several times a step on the engine's step loop: mode.needs_lora inlined)
        tokens += n
        if (adapter is not None) if unmerged else (adapter != merged):
            lora_tokens += n
            if adapter is not None:
                adapters.add(adapter)
    op = lora_op
    if mode.kind == "mixture":
        op, adapters = "delora", adapters | {merged}
    return len(batch), tokens, lora_tokens, len(adapters), op


@dataclass
class CostProfile:
    base: Grid2D  # rows: sequences in the step, cols: tokens in the step
    lora: dict[str, Grid2D]  # op -> rows: distinct adapters in the LoRA branch, cols: its tokens
    switch_ms: dict[str, float]  # op -> one all-layer merge (or unmerge)
    name: str = "profile"
    device: str = "unknown"
    model: str = "unknown"
    assumed: bool = False  # True: not measured on a device; numbers are an assumption
    note: str = ""
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%d"))

    def __post_init__(self) -> None:
        if isinstance(self.base, dict):
            self.base = Grid2D(**self.base)
        self.lora = {k: Grid2D(**v) if isinstance(v, dict) else v for k, v in self.lora.items()}
        bad = sorted(set(self.lora) - set(LORA_OPS)) + sorted(set(self.switch_ms) - set(SWITCH_OPS))
        if bad:
            raise ValueError(f"profile {self.name!r}: unknown op(s) {bad}; "
                             f"LoRA ops {LORA_OPS}, switch ops {SWITCH_OPS}")

    # ---- estimates ------------------------------------------------------------------------
    def lora_ms(self, op: str, adapters: int, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        if op not in self.lora:
            raise KeyError(f"profile {self.name!r} has no LoRA op {op!r}; it has {sorted(self.lora)}")
        return self.lora[op](max(1, adapters), tokens)

    def step_ms(self, seqs: int, tokens: int, lora_tokens: int = 0, lora_adapters: int = 0,
                lora_op: str = "atmm") -> float:
        if seqs <= 0:
            return 0.0
        return self.base(seqs, max(tokens, seqs)) + self.lora_ms(lora_op, lora_adapters, lora_tokens)

    def batch_ms(self, mode: Mode, batch: Sequence[tuple[str | None, int]], lora_op: str = "atmm",
                 image_tokens: int = 0) -> float:
        """Step time of `batch` = [(adapter, tokens this step)] in `mode`; `lora_op` is the
        unmerged operator (mixture always runs deLoRA through ATMM). `image_tokens` is taken for
        the learnt model's sake (serve/orchestrator/learned.py): the profile has no vision term."""
        if not batch:
            return 0.0
        return self.step_ms(*batch_shape(mode, batch, lora_op))

    def switch_cost_ms(self, op: str, src: str | None, dst: str | None) -> float:
        """Weights holding adapter `src` (None: base) brought to `dst`."""
        if src == dst:
            return 0.0
        if op not in self.switch_ms:
            raise KeyError(f"profile {self.name!r} has no switch op {op!r}; it has {sorted(self.switch_ms)}")
        return self.switch_ms[op] * ((src is not None) + (dst is not None))

    # ---- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        try:
            data = json.loads(Path(path).read_text())
            return cls(**data)
        except (OSError, json.JSONDecodeError, TypeError, KeyError) as e:
            raise ValueError(f"cannot read cost profile {str(path)!r}: {e}") from e


# ---- measurement ------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepShape:
    """One synthetic engine step to time: `seqs` sequences, `tokens` tokens in all; `lora_tokens`
    of them (spread over `lora_adapters` adapters) through `lora_op` (None: no LoRA work;
    "delora": mixture mode, one of the `lora_adapters` being the merged one)."""

    seqs: int
    tokens: int
    lora_op: str | None = None
    lora_tokens: int = 0
    lora_adapters: int = 0


@dataclass
class ProfileShapes:
    seqs: list[int] = field(default_factory=lambda: [1, 8, 32])
    tokens: list[int] = field(default_factory=lambda: [1, 32, 256, 1024, 4096])
    adapters: list[int] = field(default_factory=lambda: [1, 4, 16])
    lora_ops: list[str] = field(default_factory=lambda: ["atmm", "delora"])
    switch_ops: list[str] = field(default_factory=lambda: ["atmm"])


def time_call_ms(fn: Callable[[], None], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def paired_delta_ms(base: Callable[[], None], other: Callable[[], None], warmup: int, repeats: int) -> float:
    """Median over `repeats` of (time of `other` - time of `base`), the two called alternately: the
    host's slow drifts (clocks, other processes) hit both halves of a pair alike and cancel."""
    for _ in range(warmup):
        base()
        other()
    deltas = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        other()
        deltas.append((time.perf_counter() - t1 - (t1 - t0)) * 1e3)
    return statistics.median(deltas)


def measure_profile(step_fn: Callable[[StepShape], None], switch_fn: Callable[[str], None] | None,
                    shapes: ProfileShapes, *, warmup: int = 2, repeats: int = 5, name: str = "measured",
                    device: str = "unknown", model: str = "unknown",
                    progress: Callable[[str], None] | None = None) -> CostProfile:
    """Times `step_fn(shape)` (one engine step of that shape; it must wait for the device before
    returning) over the grid and `switch_fn(op)` (merge one adapter into every layer and unmerge
    it again: a round trip, timed and halved). Medians of `repeats` after `warmup` calls; the LoRA
    grids are medians of 2 * repeats + 1 paired differences (a step without LoRA work, then the
    same step with it), because a LoRA cell is a small difference of two noisy step times."""
    say = progress or (lambda _msg: None)
    base = [[time_call_ms(lambda s=s, t=t: step_fn(StepShape(s, max(t, s))), warmup, repeats)
             for t in shapes.tokens] for s in shapes.seqs]
    say(f"base: {len(shapes.seqs)}x{len(shapes.tokens)} shapes")
    lora = {}
    for op in shapes.lora_ops:
        if op not in LORA_OPS:
            raise ValueError(f"ProfileShapes.lora_ops: {op!r} is not one of {LORA_OPS}")
        rows = []
        for a in shapes.adapters:
            row = []
            for t in shapes.tokens:
                n = max(t, a)  # at least one token per adapter
                # up to the largest batch, one token per sequence (a decode step, as served: a graph
                # replay on GPU); past it, one sequence per adapter (prefill chunks)
                s = n if n <= shapes.seqs[-1] else a
                extra = paired_delta_ms(lambda s=s, n=n: step_fn(StepShape(s, n)),
                                        lambda s=s, n=n, a=a, op=op: step_fn(StepShape(s, n, op, n, a)),
                                        warmup, 2 * repeats + 1)
                row.append(max(0.0, extra))
            rows.append(row)
        lora[op] = Grid2D([float(a) for a in shapes.adapters], [float(t) for t in shapes.tokens], rows)
        say(f"lora {op}: {len(shapes.adapters)}x{len(shapes.tokens)} shapes")
    switch = {}
    for op in shapes.switch_ops if switch_fn is not None else ():
        if op not in SWITCH_OPS:
            raise ValueError(f"ProfileShapes.switch_ops: {op!r} is not one of {SWITCH_OPS}")
        switch[op] = time_call_ms(lambda op=op: switch_fn(op), warmup, repeats) / 2
        say(f"switch {op}: {switch[op]:.2f} ms")
    return CostProfile(Grid2D([float(s) for s in shapes.seqs], [float(t) for t in shapes.tokens], base),
                       lora, switch, name=name, device=device, model=model, assumed=False,
                       note=f"measured: median of {repeats} after {warmup} warm-up calls")
