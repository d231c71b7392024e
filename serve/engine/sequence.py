"""A request's token sequence as the scheduler and block manager see it (no torch here).

`token_ids` holds the prompt followed by the generated tokens; the first
`num_computed_tokens` of them have K/V in the cache. A running sequence is scheduled for
`num_tokens - num_computed_tokens` more tokens: a (chunk of a) prefill, or one decode token.
Preemption by recompute only resets `num_computed_tokens` and the block table.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class MMSpan:
    """Placeholder tokens [start, end) of one image or clip, and its content hash."""

    start: int
    end: int
    key: str


_ids = itertools.count()


@dataclass
class RunState:
    """The engine's and model runner's per-sequence state: set at admission, filled as it runs.
    Objects of the torch side are typed Any here, so the scheduler's modules stay torch-free."""

    sampling: Any = None  # SamplingParams
    vision: tuple = ()  # VisionInput of each image / clip, in prompt order
    prompt_positions: Any = None  # M-RoPE positions of the prompt (None with 1-D RoPE)
    mrope_delta: int = 0  # M-RoPE: generated token t sits at position t + delta
    head: Any = None  # the TaskHead of a head-mode request
    generator: Any = None  # torch.Generator of a request with its own seed
    embeds: dict = field(default_factory=dict)  # content hash -> vision embeddings its prefill still needs
    logits: list = field(default_factory=list)  # one row per sampled token when sampling.keep_logits
    head_rows: list | None = None  # head mode: hidden rows gathered over the prompt's chunks
    head_result: Any = None  # head mode: the head's answer once the prompt is computed


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    adapter: str | None = None  # part of the prefix-cache key (KV depends on the adapter)
    mm_spans: tuple[MMSpan, ...] = ()
    state: RunState = field(default_factory=RunState)
    seq_id: int = field(default_factory=lambda: next(_ids))
    prompt_len: int = -1
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # served from the prefix cache at the last admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # content hashes of full blocks, memoized
    block_keys: list[tuple] = field(default_factory=list)  # what each hash was made of (checked on a hit)
    num_hashed_blocks: int = 0  # leading blocks registered in (or taken from) the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    adapter_version: int = 0  # with the name: a reloaded adapter never shares blocks with its old self
    prefill_only: bool = False  # head mode: finishes (reason "head") once its prompt is computed
    reuse_prefix: bool = True  # may take cached blocks (off when every prompt row's hidden state is needed)
    owner: str | None = None  # who submitted it: the scheduler's fair order lets owners take turns
    # the tenant it is served for: tenants share each step's prompt tokens by weight (deficit round
    # robin, serve/engine/tenancy.py) and at most `tenant_max_running` of one tenant's run at once
    tenant: str | None = None
    tenant_weight: float = 1.0
    tenant_max_running: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.token_ids)
        if self.prompt_len < 1:
            raise ValueError(f"request {self.request_id!r}: the prompt has no tokens")
        # a weight of 0, inf or nan would give the tenant no share or every share (the step's
        # arithmetic divides by the weights' sum): refused here, before the request reaches a step
        if not (type(self.tenant_weight) in (int, float) and 1e-3 <= self.tenant_weight <= 1e3):
            raise ValueError(f"request {self.request_id!r}: tenant_weight must be a number in [0.001, 1000], "
                             f"got {self.tenant_weight!r}")
        cap = self.tenant_max_running
        if cap is not None and not (type(cap) is int and cap >= 1):
            raise ValueError(f"request {self.request_id!r}: tenant_max_running must be an integer >= 1 or None, "
                             f"got {cap!r}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_remaining(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
