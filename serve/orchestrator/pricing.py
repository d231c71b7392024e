"""Prices of whole steps: what a plan (a mode and the requests it admits) costs for the step the
engine will actually run, and for the decode steps its batch goes on with.

A plan's step is built the way the scheduler builds it (serve/engine/scheduler.py): the running
requests first (a decoding one: 1 token; one still prefilling: its next chunk), then the admitted
ones in order while batch slots and the token budget last, each with as much of its prompt as the
budget leaves (chunked prefill). Its image tokens are those of the prompt chunks it prefills (the
vision tower encodes them in that step). The price of a plan, in ms per token, is

    (this step + H decode steps of the requests that go on generating + the switch's share)
    / (this step's tokens + H * those requests)

H being the mean of their remaining decode steps: a mode holds for many steps, so a plan is not
judged by one prefill chunk alone, nor (as decode-only pricing did) without it. A switch is spread
over the steps the new weights are expected to stay (`dwell_steps`, learnt from the policy's own
stints between switches): the plan's steps pay their share of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .types import Mode, RequestView, StepView


@dataclass
class PlannedStep:
    entries: list[tuple[str | None, int]]  # (adapter, tokens this step)
    image_tokens: int
    goes_on: list[RequestView]  # requests that keep generating after this step
    horizon: float  # mean decode steps left to them after this step
    tokens: int = 0  # this step's tokens (the entries' sum)
    decoders: list[tuple[str | None, int]] = ()  # (adapter, 1) of each request in goes_on: its decode steps


def _chunk_images(r: RequestView, chunk: int) -> int:
    """Image tokens in the next `chunk` prompt tokens of `r` (spread evenly over what is left)."""
    left = r.remaining_prompt
    return 0 if left <= 0 or not r.image_tokens else round(r.image_tokens * min(chunk, left) / left)


def planned_step(view: StepView, batch: Sequence[RequestView]) -> PlannedStep:
    """The step the scheduler runs for `batch` (running requests first, then admitted, in order)."""
    budget, entries, images, goes_on = view.max_tokens_per_step, [], 0, []
    tokens = 0
    for r in batch:
        if budget <= 0:
            break
        left = r.remaining_prompt
        n = 1 if left <= 0 else min(left, budget)
        if r.image_tokens:
            images += _chunk_images(r, n)
        budget -= n
        tokens += n
        entries.append((r.adapter, n))
        prefill_done = left <= n
        after = r.remaining_output - (1 if prefill_done else 0)  # the step that ends the prompt samples a token
        if r.output_mode == "generate" and after > 0:
            goes_on.append((r, after))
    horizon = sum(a for _, a in goes_on) / len(goes_on) if goes_on else 0.0
    return PlannedStep(entries, images, [r for r, _ in goes_on], horizon, tokens, [(r.adapter, 1) for r, _ in goes_on])


def plan_price(costs, view: StepView, mode: Mode, admit: Sequence[RequestView], lora_op: str, switch_op: str,
               dwell_steps: float, merged_only: bool = False, cache: dict | None = None) -> float:
    """ms per token of running `mode` with the running requests plus `admit` (as many as fit).
    merged_only: once the other adapters' running requests have finished (hold's merged phase).
    cache: planned steps of this decision by (admitted ids, merged adapter kept), shared by its plans
    (and with the decision's own predicted step: adaptive.py); the running requests are the view's."""
    admitted = admit[:view.free_slots]
    key = (tuple([r.request_id for r in admitted]), mode.merged_adapter if merged_only else None)
    step = cache.get(key) if cache is not None else None
    if step is None:
        batch = [*view.running, *admitted]
        if merged_only:
            batch = [r for r in batch if r.adapter == mode.merged_adapter]
        step = planned_step(view, batch)
        if cache is not None:
            cache[key] = step
    if not step.entries:
        return float("inf")
    ms = costs.batch_ms(mode, step.entries, lora_op, step.image_tokens)
    decoders = step.decoders
    ms += step.horizon * costs.batch_ms(mode, decoders, lora_op) if decoders else 0.0
    tokens = step.tokens + step.horizon * len(decoders)
    steps = 1 + step.horizon
    switch = costs.switch_cost_ms(switch_op, view.mode.merged_adapter, mode.merged_adapter)
    return (ms + switch * steps / max(steps, dwell_steps)) / tokens


def hold_price(costs, view: StepView, a: str, mine: Sequence[RequestView], lora_op: str, switch_op: str,
               dwell_steps: float, cache: dict | None = None) -> float:
    """hold(a): the other adapters' running requests finish in mixture(a) while a's requests join;
    the priced steps split between that mixed phase and the merged one after it, by the share of
    the batch's horizon the others take to drain."""
    mixed = plan_price(costs, view, Mode.mixture(a), mine, lora_op, switch_op, dwell_steps, cache=cache)
    others = [r for r in view.running if r.adapter != a]
    if not others:
        return mixed  # nobody else: the step is a's alone (merged)
    merged = plan_price(costs, view, Mode.mixture(a), mine, lora_op, switch_op, dwell_steps, True, cache)
    if merged == float("inf"):
        return mixed
    step = (cache or {}).get((tuple([r.request_id for r in mine[:view.free_slots]]), None)) \
        or planned_step(view, [*view.running, *mine[:view.free_slots]])
    horizon = max(1.0, step.horizon)
    drain = min(horizon, max(r.remaining_output for r in others))
    return (drain * mixed + (horizon - drain) * merged) / horizon


def fixed_costs(costs, mode: Mode, entries: Sequence[tuple[str | None, int]], lora_op: str,
                image_tokens: int, last_top: str | None, switch_op: str) -> tuple[float, float, str | None]:
    """Predicted ms of the served `entries` under the fixed modes the guard compares with:
    (unmerge, merge = the most requested adapter merged plus a switch when it changed, that adapter).
    Most requested: by the step's sequences, not its tokens, as the fallback picks it (the policy's
    _top) and as a fixed mode would hold it. Counted by tokens, a step prefilling another adapter's
    picture made that adapter the top one for that step alone: the reference merged whichever adapter
    prefilled, an oracle no fixed mode can follow, and the guard then forced mixture on a policy that
    had rightly left it."""
    unmerge = costs.batch_ms(Mode.unmerge(), entries, lora_op, image_tokens)
    top = fixed_top(entries, last_top)
    if top is None:
        return unmerge, unmerge, last_top
    merge = costs.batch_ms(Mode.mixture(top), entries, lora_op, image_tokens)
    merge += costs.switch_cost_ms(switch_op, last_top, top)
    return unmerge, merge, top


def fixed_top(entries: Sequence[tuple[str | None, int]], last_top: str | None) -> str | None:
    """The adapter the guard's fixed merge mode holds for `entries`: the most requested by sequences
    (ties: the one it held), or `last_top` when the step ran base-model requests only."""
    counts: dict[str, int] = {}
    for adapter, _ in entries:
        if adapter is not None:
            counts[adapter] = counts.get(adapter, 0) + 1
    return max(counts, key=lambda k: (counts[k], k == last_top)) if counts else None


# ---- decode-only prices (price="decode": the rule before whole-step prices) -------------------
def _decode_horizon(batch: Sequence[RequestView]) -> float:
    """Steps a batch's composition lasts: the mean remaining output of its requests."""
    return max(1.0, sum(r.remaining_output for r in batch) / len(batch))


def decode_plan_price(costs, view: StepView, mode: Mode, admit: Sequence[RequestView], lora_op: str, switch_op: str,
                      merged_only: bool = False) -> float:
    """ms per sequence of the decode step that `mode` runs with the running requests plus `admit`
    (as many as fit), a switch from the current weights spread over the steps the batch lasts."""
    batch = [*view.running, *admit[:view.free_slots]]
    if merged_only:
        batch = [r for r in batch if r.adapter == mode.merged_adapter]
    if not batch:
        return float("inf")
    step = costs.batch_ms(mode, [(r.adapter, 1) for r in batch], lora_op)
    switch = costs.switch_cost_ms(switch_op, view.mode.merged_adapter, mode.merged_adapter)
    return (step + switch / _decode_horizon(batch)) / len(batch)


def decode_hold_price(costs, view: StepView, a: str, mine: Sequence[RequestView], lora_op: str,
                      switch_op: str) -> float:
    others = [r for r in view.running if r.adapter != a]
    mixed = decode_plan_price(costs, view, Mode.mixture(a), mine, lora_op, switch_op)
    merged = decode_plan_price(costs, view, Mode.mixture(a), mine, lora_op, switch_op, merged_only=True)
    if not others:
        return merged
    horizon = _decode_horizon([*view.running, *mine[:view.free_slots]])
    drain = min(horizon, max(r.remaining_output for r in others))
    if merged == float("inf"):
        return mixed
    return (drain * mixed + (horizon - drain) * merged) / horizon
