"""Baseline policies, each with its own rule, run by the same engine (or simulator) for fair comparison.

- `FCFSPolicy`: arrival order, the mode left as it is (the engine starts unmerged): what the
  engine does without an orchestrator.
- `UnmergeOnlyPolicy` (S-LoRA / Punica style): always unmerge, every adapter through ATMM,
  arrival order.
- `MergeOnlyPolicy`: one adapter merged at a time, only its requests run. It stays on the
  merged adapter while that adapter has requests and no other request has waited
  `max_wait_ms`; then it stops admitting, lets the running requests finish and merges the
  adapter of the oldest waiting request (base-model requests run unmerged, with no LoRA work).
- `DLoRAPolicy` (dLoRA style): unmerge through einsum, per-layer addmm switches, no mixture.
  Each step it estimates the throughput (sequences per ms) of the next step merged (the most
  requested adapter's requests) and unmerged (everyone), charges a switch amortized over
  `window_steps` steps, and takes the better; requests of other adapters pause while merged.
  Credit-based anti-starvation: once a request of another adapter has waited (or been paused)
  `max_wait_ms`, it unmerges.
- `DLoRAATMMPolicy` ("dlora_atmm"): the same rule on our operators (ATMM, one-shot switches), so
  the rule and the kernels can be told apart.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .base import Policy, fcfs
from .profile import CostProfile
from .types import Decision, Mode, StepView


MIN_STEP_MS = 1e-6


def _ids(requests, limit: int) -> tuple[str, ...]:
    return tuple(r.request_id for r in requests[:limit])


@dataclass
class UnmergedConfig:
    lora_op: str = "atmm"
    switch_op: str = "atmm"


class FCFSPolicy(Policy):
    name = "fcfs"

    def __init__(self, profile: CostProfile, config: UnmergedConfig | None = None, log_size: int = 1000):
        super().__init__(profile, log_size)
        self.config = config or UnmergedConfig()
        self.lora_op, self.switch_op = self.config.lora_op, self.config.switch_op

    def _decide(self, view: StepView) -> Decision:
        mode = view.mode
        admit = [r for r in fcfs(view.waiting) if mode.can_run(r.adapter)]
        return Decision(mode, _ids(admit, view.free_slots), reason="fcfs: arrival order, mode kept")


class UnmergeOnlyPolicy(FCFSPolicy):
    name = "unmerge_only"

    def _decide(self, view: StepView) -> Decision:
        return Decision(Mode.unmerge(), _ids(fcfs(view.waiting), view.free_slots), reason="unmerge: always")


@dataclass
class MergeOnlyConfig:
    max_wait_ms: float = 2000.0  # another adapter's oldest request waiting this long forces a turn
    switch_op: str = "atmm"


class MergeOnlyPolicy(Policy):
    name = "merge_only"

    def __init__(self, profile: CostProfile, config: MergeOnlyConfig | None = None, log_size: int = 1000):
        super().__init__(profile, log_size)
        self.config = config or MergeOnlyConfig()
        self.switch_op = self.config.switch_op

    def _decide(self, view: StepView) -> Decision:
        mode, now = view.mode, view.now_ms
        cur = mode.merged_adapter  # None: base weights (start, or serving base-model requests)
        queue = fcfs(view.waiting)
        mine = [r for r in queue if r.adapter == cur]
        others = [r for r in queue if r.adapter != cur]
        overdue = bool(others) and now - others[0].arrival_ms >= self.config.max_wait_ms
        if mine and not overdue:
            return Decision(mode, _ids(mine, view.free_slots), reason=f"merge: serve {cur}")
        if not others:
            return Decision(mode, reason=f"merge: {cur} drains, nothing else waits")
        if view.running:
            why = "overdue" if overdue else "no more requests of the merged adapter"
            return Decision(mode, reason=f"drain: {why}, waiting for {len(view.running)} running to finish")
        nxt = others[0].adapter
        target = Mode.unmerge() if nxt is None else Mode.merge(nxt)
        admit = [r for r in queue if r.adapter == nxt]
        return Decision(target, _ids(admit, view.free_slots), reason=f"turn: merge {nxt} (oldest waiting)")


@dataclass
class DLoRAConfig:
    max_wait_ms: float = 2000.0  # anti-starvation: another adapter's request waiting this long unmerges
    window_steps: int = 32  # a switch is charged over this many steps (a merge phase lasts about this long)
    lora_op: str = "einsum"
    switch_op: str = "addmm"


class DLoRAPolicy(Policy):
    name = "dlora"

    def __init__(self, profile: CostProfile, config: DLoRAConfig | None = None, log_size: int = 1000):
        super().__init__(profile, log_size)
        self.config = config or DLoRAConfig()
        self.lora_op, self.switch_op = self.config.lora_op, self.config.switch_op
        self._paused_since: dict[str, float] = {}  # running request id -> when it was first paused

    def _throughput(self, mode: Mode, reqs, max_bs: int, cur: str | None) -> float:
        """Sequences per ms of the next decode-shaped step in `mode`, the switch amortized."""
        batch = [(r.adapter, 1) for r in reqs[:max_bs]]
        if not batch:
            return 0.0
        ms = self.profile.batch_ms(mode, batch, self.lora_op)
        ms += self.profile.switch_cost_ms(self.switch_op, cur, mode.merged_adapter) / self.config.window_steps
        # a measured profile's cell can be 0.0 (differences are clipped at 0, extrapolation too), and the
        # requests' token counts pick the cell: a free step is "very fast", not a division by zero
        return len(batch) / max(ms, MIN_STEP_MS)

    def _decide(self, view: StepView) -> Decision:
        mode, now, cur = view.mode, view.now_ms, view.mode.merged_adapter
        if not view.waiting and not view.running:
            return Decision(mode, reason="idle")
        present = fcfs(view.running + view.waiting)
        counts = Counter(r.adapter for r in present if r.adapter is not None)
        queue = fcfs(view.waiting)
        # how long each request has been kept from running: waiting since arrival, paused since pausing
        held = {r.request_id: now - r.arrival_ms for r in view.waiting}
        held.update({i: now - t for i, t in self._paused_since.items()})
        if counts:
            top = min(counts, key=lambda a: (-counts[a], a != cur, a))
            overdue = [r for r in present if r.adapter != top
                       and held.get(r.request_id, 0.0) >= self.config.max_wait_ms]
            merged = Mode.merge(top)
            t_merge = self._throughput(merged, [r for r in present if r.adapter == top], view.max_batch_size, cur)
            t_unmerge = self._throughput(Mode.unmerge(), present, view.max_batch_size, cur)
            if not overdue and t_merge > t_unmerge:
                pause = tuple(r.request_id for r in view.running if r.adapter != top)
                self._paused_since = {i: self._paused_since.get(i, now) for i in pause}
                admit = [r for r in queue if r.adapter == top]
                return Decision(merged, _ids(admit, view.free_slots), pause,
                                reason=f"merge: {t_merge:.3f} > {t_unmerge:.3f} seq/ms unmerged")
            why = f"{len(overdue)} overdue" if overdue else f"{t_unmerge:.3f} >= {t_merge:.3f} seq/ms merged"
        else:
            why = "no adapter requests"
        self._paused_since = {}
        return Decision(Mode.unmerge(), _ids(queue, view.free_slots), reason=f"unmerge: {why}")

    def reset(self) -> None:
        super().reset()
        self._paused_since = {}


@dataclass
class DLoRAATMMConfig(DLoRAConfig):
    lora_op: str = "atmm"
    switch_op: str = "atmm"


class DLoRAATMMPolicy(DLoRAPolicy):
    name = "dlora_atmm"
