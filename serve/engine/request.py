"""What a client submits (`Request`, `SamplingParams`) and what it gets back (`RequestOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serve.orchestrator.types import check_priority

OUTPUT_MODES = ("generate", "head")
MAX_INT64 = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()  # besides the checkpoint's end-of-sequence tokens
    ignore_eos: bool = False  # do not stop at the end-of-sequence tokens (benchmarks)
    seed: int | None = None  # a per-request generator: the same seed gives the same tokens in any batch
    keep_logits: bool = False  # return each step's float32 logits (oracle tests)
    detokenize: bool = True  # text deltas per step; off for token-id clients and benchmarks

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        # every field is bounded to what one step can execute: a value past these would fail inside
        # the batched step (int64 tensors, torch generators) and take every request of the batch along
        if not 0 <= self.top_k <= MAX_INT64:
            raise ValueError(f"top_k must lie in [0, 2**63 - 1] (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed <= MAX_INT64:
            raise ValueError(f"seed must lie in [0, 2**63 - 1], got {self.seed}")
        if not all(0 <= t <= MAX_INT64 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids in [0, 2**63 - 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Request:
    """One inference request. Give `prompt` (plain text: the chat template and the image
    placeholders are added), `messages` (chat messages in the processor's format, with
    {"type": "image"} / {"type": "video"} entries), `prompt` with `raw_prompt=True` (text
    that already holds template and placeholders) or `prompt_token_ids` (text only)."""

    prompt: str | None = None
    messages: list[dict] | None = None
    images: list[Any] = field(default_factory=list)  # PIL images, uint8 [H, W, 3] arrays or encoded bytes
    video: Any = None  # frames: uint8 [T, H, W, 3] or a list of images (Qwen only)
    adapter: str | None = None  # LoRA adapter name; None = base model
    output_mode: str = "generate"  # "generate" (LM head) | "head" (the adapter's task head)
    task: str | None = None  # head mode: the head's domain (or task); None = the adapter's only head
    sampling: SamplingParams = field(default_factory=SamplingParams)
    app: str | None = None  # application tag
    slo_ms: float | None = None  # latency objective of the application
    # > 1: the orchestrator's policy counts this request starving sooner (its credit times priority
    # against its target) and serves it first among the starving; the RPC server sets it from the
    # application's name (rpc.app_priorities), never from what a client asks
    priority: float = 1.0
    request_id: str | None = None
    # who submitted it (the RPC server puts the connection here): waiting requests of different
    # owners take turns, so one owner's backlog cannot starve another's request
    owner: str | None = None
    # the tenant it is served for (the RPC server sets it from the connection's token): the engine's
    # tokens are shared out between tenants by `tenant_weight`, and at most `tenant_max_running` of a
    # tenant's requests run in one batch (None: no cap)
    tenant: str | None = None
    tenant_weight: float = 1.0
    tenant_max_running: int | None = None
    raw_prompt: bool = False
    prompt_token_ids: list[int] | None = None
    # when it reached the serving loop (time.perf_counter; set by the server, not a client): a tenant's gap
    # between requests is learned to this, not to when a step in flight let the loop take it in
    # (serve/engine/anticipation.py). None: when add_request takes it in
    received: float | None = None

    def __post_init__(self) -> None:
        if self.output_mode not in OUTPUT_MODES:
            raise ValueError(f"output_mode {self.output_mode!r} is not one of {OUTPUT_MODES}")
        check_priority(self.priority)


# ModelRunner.run's host phases, in order: the step's inputs (and LoRA batch), its pictures' vision work, the
# language model's launches, the heads' and sampling's launches, the next step's pictures queued (encode_ahead),
# then the wait for the device's results
STEP_PHASES = ("inputs", "vision", "forward", "sample", "ahead", "wait")


def phases_ms(phases: tuple) -> dict:
    """A step's phase seconds (RequestMetrics.first_phases_s, last_phases_s) as {phase: ms}; {} when not recorded."""
    return {name: round(s * 1e3, 3) for name, s in zip(STEP_PHASES, phases)}


@dataclass
class RequestMetrics:
    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    # the steps it ran in, summed (where its time from first scheduled to finished went; the rest is the
    # serving loop's between steps): their count, wall time from planned to outputs, their tokens of all
    # requests, the arrivals taken in during them (mid-step), the planning of those after its first, how
    # many replayed a CUDA graph, and its first step's wall time and tokens apart (its prefill, if short)
    steps: int = 0
    step_s: float = 0.0
    step_tokens: int = 0
    intake_s: float = 0.0
    plan_s: float = 0.0
    graph_steps: int = 0
    first_step_s: float = 0.0
    first_step_tokens: int = 0
    # the host's seconds in each of the runner's phases (ModelRunner.PHASES) of its first step and of its latest:
    # which part of a step grew when another's requests rode in it (references to the runner's log, no copy)
    first_phases_s: tuple = ()
    last_phases_s: tuple = ()
    # the stepping thread's CPU seconds in its first step and in its latest (beside first_step_s and last_step_s,
    # their wall): a step slower by more work spends the CPU time too; one slower by waiting (for the interpreter,
    # a core or the device) does not
    first_step_cpu_s: float = 0.0
    last_step_s: float = 0.0
    last_step_cpu_s: float = 0.0
    # from taken in to its first step: the steps that ran without it, and the loop's waits for returning tenants
    steps_before: int = 0
    lingered_before_s: float = 0.0
    # garbage collections of the process from taken in to its first step, and to finished (serve/engine/garbage.py)
    gc_before_s: float = 0.0
    gc_s: float = 0.0
    # steps that ran others' work while it waited and its tenant had nothing in the engine running, and the
    # first such step's state (the plan's admit list, the batch, the blocks)
    passed_over: int = 0
    passed_reason: str = ""

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's progress after a step: the new tokens (streaming) and everything so far."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "head"
    metrics: RequestMetrics
    app: str | None = None
    logits: list | None = None  # float32 [vocab] tensors, one per generated token (keep_logits)
    head: Any = None  # head mode: the heads.HeadResult (label / count / boxes / answer; .to_dict())
