"""Which pictures the next step will need, guessed while the current step runs on the device.

The engine encodes them then (`EngineConfig.encode_ahead`, ModelRunner.encode_ahead), behind the
current step's kernels and before the host waits for its results: the device gets the vision tower's
work while the host plans the next step, builds its inputs and launches it, time in which it had
nothing to do before (15% of the wall at 64 chunks on an H100). No torch here.

The guess walks the queues as the scheduler will, in outline: the step's prompt tokens (after one
token per decoding sequence) are split between tenants by their weights, what a tenant cannot use
going round again, as the scheduler's deficit round robin does without its carried deficits, and a
tenant over its share of the batch held to its step cap (`tenancy.step_caps`; guessed without it, a
flood of one-token image requests had seven of its pictures encoded inside each of another tenant's
steps, which the cap then kept out of the step after); within a tenant, sequences take its tokens in
the policy's order, prompts being prefilled first, then waiting ones while the batch has slots. A
wrong guess costs no correctness and little time: each encoded item is held by its own sequence
until its prefill reaches it (and kept in the encoder cache for others with the same pixels).

A waiting prompt whose prefix the running step computes (a shared template) finds that prefix
cached only after the step; the guess then falls short of its pictures, which are encoded at their
own step as before.
"""

from __future__ import annotations

from .tenancy import share_of, short_of_pictures, step_caps, water_fill


def upcoming_vision(scheduler, batch, budget: int) -> list[tuple]:
    """(sequence, vision item) pairs of the prompt tokens the step after `batch` is likely to carry,
    `budget` tokens at most; `batch` is the step now running (its chunks count as computed)."""
    stepped = {id(seq): n for seq, n in batch.entries}
    order, bm = scheduler.policy.order, scheduler.block_manager
    prefilling = []  # (sequence, first token of its next chunk)
    active = []
    for seq in order(scheduler.running):
        start = seq.num_computed_tokens + stepped.get(id(seq), 0)
        if seq.is_finished or start >= seq.num_tokens and seq.prefill_only:
            continue  # done with this step
        active.append(seq)
        if start >= seq.prompt_len:
            budget -= 1  # a decoding sequence's token
        else:
            prefilling.append((seq, start))
    slots = max(0, scheduler.config.max_batch_size - len(active))
    waiting = order(scheduler.waiting)[:slots]
    # a waiting prompt starts past its cached prefix, as the scheduler will admit it
    prefilling += [(seq, max(seq.num_computed_tokens, bm.num_cached_tokens(seq))) for seq in waiting]
    needs, weights = {}, {}
    for seq, start in prefilling:
        needs[share_of(seq)] = needs.get(share_of(seq), 0) + seq.prompt_len - start
        weights[share_of(seq)] = seq.tenant_weight
    tokens = water_fill(needs, weights, max(0, budget), list(needs))
    caps = step_caps(active, waiting, slots, stepped, bm.num_cached_tokens,
                     tokens if scheduler.quiet_ready() else None) if scheduler.config.tenant_step_cap else None
    for tenant in caps or ():
        if tenant in tokens:
            tokens[tenant] = caps.allow(tenant, tokens[tenant], True)
    out = []
    for seq, start in prefilling:
        n = min(seq.prompt_len - start, tokens[share_of(seq)])
        if caps and seq.tenant in caps:  # as the scheduler cuts a capped chunk
            n = short_of_pictures(seq, start, n, caps.prompt_left(seq.tenant))
        if n <= 0:
            continue
        tokens[share_of(seq)] -= n
        end, held = start + n, seq.state.embeds
        out.extend((seq, item) for item in seq.state.vision
                   if item.offset < end and item.offset + item.num_tokens > start and item.content_hash not in held)
    return out
