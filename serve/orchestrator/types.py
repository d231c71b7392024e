"""What a scheduling policy sees each iteration and what it answers (no torch here).

Times are milliseconds on one monotonic clock (the engine converts its `time.perf_counter()`
seconds; the simulator, serve.sim, keeps its own). The engine builds one `StepView` per iteration from its queues, calls
`policy.decide(view)` and then, under the engine's own token budget and memory checks:

1. brings the weights to `decision.mode.merged_adapter` if they hold another adapter (a switch;
   the engine times it and never lets it change the tokens of a running request);
2. runs every running request except those in `decision.pause`;
3. admits from `decision.admit` in that order, and nobody who is not listed: it stops at the
   first the batch size, the token budget or the free K/V blocks do not allow, and passes over
   one whose adapter is still being swapped in (the rest of the list goes on).

Modes and what they can run (the engine computes whatever LoRA work a mode needs):

| mode          | weights hold | requests of the merged adapter | other adapters / no adapter |
| ------------- | ------------ | ------------------------------ | --------------------------- |
| unmerge       | base         | ATMM                           | ATMM / plain                |
| merge(a)      | base + dW_a  | plain, no LoRA work            | cannot run                  |
| mixture(a)    | base + dW_a  | plain, no LoRA work            | deLoRA: -dW_a + dW_x        |

`merge(a)` and `mixture(a)` hold the same weights: going from one to the other is free; the
difference is only which requests the policy lets in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MODE_KINDS = ("unmerge", "merge", "mixture")
OUTPUT_MODES = ("generate", "head")


def check_priority(value: Any, name: str = "priority") -> None:
    """A priority as the policy reads it: a positive finite number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class Mode:
    kind: str = "unmerge"
    adapter: str | None = None  # the merged adapter (merge, mixture); None for unmerge

    def __post_init__(self) -> None:
        if self.kind not in MODE_KINDS:
            raise ValueError(f"mode kind {self.kind!r} is not one of {MODE_KINDS}")
        if (self.kind == "unmerge") != (self.adapter is None):
            raise ValueError(f"mode {self.kind!r} needs {'no' if self.kind == 'unmerge' else 'an'} adapter, "
                             f"got adapter={self.adapter!r}")

    # the policies name modes many times a step on the engine's step loop (each plan they price): a
    # mode is a frozen value, so each (kind, adapter) is built and checked once and then handed out
    @classmethod
    def unmerge(cls) -> Mode:
        return _made("unmerge", None)

    @classmethod
    def merge(cls, adapter: str) -> Mode:
        return _made("merge", adapter)

    @classmethod
    def mixture(cls, adapter: str) -> Mode:
        return _made("mixture", adapter)

    @property
    def merged_adapter(self) -> str | None:
        """The adapter folded into the weights: what a switch changes."""
        return self.adapter

    def can_run(self, adapter: str | None) -> bool:
        return self.kind != "merge" or adapter == self.adapter

    def needs_lora(self, adapter: str | None) -> bool:
        """Whether a request of `adapter` does LoRA work (ATMM or deLoRA) in this mode."""
        if self.kind == "unmerge":
            return adapter is not None
        return adapter != self.adapter

    def __str__(self) -> str:
        return self.kind if self.adapter is None else f"{self.kind}({self.adapter})"


_MODES: dict[tuple[str, str | None], Mode] = {}


def _made(kind: str, adapter: str | None) -> Mode:
    mode = _MODES.get((kind, adapter))
    if mode is None:
        mode = Mode(kind, adapter)
        if len(_MODES) < 4096:  # (adapter names come from requests: keep the table bounded)
            _MODES[(kind, adapter)] = mode
    return mode


@dataclass(frozen=True)
class RequestView:
    """One request as the policy sees it: waiting (not admitted yet) or running."""

    request_id: str
    adapter: str | None
    arrival_ms: float
    prompt_tokens: int  # whole prompt, image/video placeholders included
    output_tokens: int  # expected tokens to generate (max_tokens); 1 for a head request
    output_mode: str = "generate"  # "generate" | "head" (one prefill, then the task head)
    app: str | None = None
    slo_ms: float | None = None  # latency target of its application; None: the policy's default
    priority: float = 1.0  # > 1: starves sooner and is served first among the starving
    computed_tokens: int = 0  # prompt tokens already prefilled (running, chunked prefill)
    generated_tokens: int = 0  # tokens generated so far (running)
    image_tokens: int = 0  # placeholder tokens of images/clips not yet prefilled (the vision tower encodes them)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: output_tokens must be >= 1, got {self.output_tokens}")
        if self.output_mode not in OUTPUT_MODES:
            raise ValueError(f"request {self.request_id!r}: output_mode {self.output_mode!r} "
                             f"is not one of {OUTPUT_MODES}")
        if self.priority <= 0:
            raise ValueError(f"request {self.request_id!r}: priority must be > 0, got {self.priority}")
        if not 0 <= self.image_tokens <= self.prompt_tokens:
            raise ValueError(f"request {self.request_id!r}: image_tokens must lie in [0, prompt_tokens="
                             f"{self.prompt_tokens}], got {self.image_tokens}")

    @property
    def remaining_prompt(self) -> int:
        return self.prompt_tokens - self.computed_tokens

    @property
    def remaining_output(self) -> int:
        return self.output_tokens - self.generated_tokens


@dataclass(frozen=True)
class StepView:
    """Everything the policy may look at for one iteration."""

    now_ms: float
    waiting: tuple[RequestView, ...]
    running: tuple[RequestView, ...]
    mode: Mode
    max_batch_size: int
    max_tokens_per_step: int

    @property
    def free_slots(self) -> int:
        return max(0, self.max_batch_size - len(self.running))


@dataclass(frozen=True)
class Decision:
    mode: Mode
    admit: tuple[str, ...] = ()  # waiting request ids, in admission order
    pause: tuple[str, ...] = ()  # running request ids not to run this step (merge mode)
    switch: bool = False  # the weights change: mode.merged_adapter differs from the current one
    reason: str = ""
    starving: int = 0  # waiting requests over their tolerance when the decision was taken


@dataclass
class DecisionRecord:
    now_ms: float
    mode: str
    switch: bool
    admitted: int
    starving: int
    waiting: int
    running: int
    reason: str
    predicted_ms: float | None = None  # the cost model's ms for the step this decision plans (learning policies)
    measured_ms: float | None = None  # the step's measured ms once it ran


@dataclass
class PolicyStats:
    """Counted over every `decide` call; `switch_ms` is the profile's estimate (the engine
    reports the measured switch times)."""

    decisions: int = 0
    steps_by_mode: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MODE_KINDS, 0))
    switches: int = 0
    switch_ms: float = 0.0
    admitted: int = 0
    paused: int = 0
    max_starving: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    # a policy that learns from measured steps (V-LoRA's): reports, taken when asked (as_dict), of its
    # predicted vs measured step costs (serve.orchestrator.learned.LearnedCosts.report) and of its
    # guard against the fixed modes (serve.orchestrator.guard.FixedModeGuard.report); None otherwise
    learning: Callable[[], dict] | None = None
    guard: Callable[[], dict] | None = None
    # wall time the engine's step loop spent planning (the view, decide, the admit list) and handing
    # the policy its measured step, on the host in series with the device (the engine's planner times it)
    host_ms: float = 0.0
    host_steps: int = 0

    def as_dict(self) -> dict:
        return {"decisions": self.decisions, "steps_by_mode": dict(self.steps_by_mode),
                "switches": self.switches, "switch_ms": self.switch_ms, "admitted": self.admitted,
                "paused": self.paused, "max_starving": self.max_starving, "reasons": dict(self.reasons),
                "host_ms": self.host_ms, "host_steps": self.host_steps,
                "learning": self.learning() if self.learning else None,
                "guard": self.guard() if self.guard else None}
