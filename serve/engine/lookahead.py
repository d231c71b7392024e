"""Which pictures the next step will need, guessed while the current step runs on the device.

The engine encodes them then (`EngineConfig.encode_ahead`, ModelRunner.encode_ahead), behind the
current step's kernels and before the host waits for its results: the device gets the vision tower's
work while the host plans the next step, builds its inputs and launches it, time in which it had
nothing to do before (14% of the wall at 64 chunks on an H200). No torch here.

The guess walks the queues as the scheduler will, without its fair shares and tenant caps: prompts
still being prefilled after this step first, then waiting ones, each in the policy's order, over
one step's prompt tokens. A wrong guess costs no correctness: an encoded item waits in the encoder
cache, keyed by its pixels, for the step that does take it. A waiting prompt whose prefix the
running step computes (a shared template) finds that prefix cached only after the step; the guess
then falls short of its pictures, which are encoded at their own step as before.
"""

from __future__ import annotations


def upcoming_vision(scheduler, batch, budget: int) -> list[tuple]:
    """(sequence, vision item) pairs of the prompt tokens the step after `batch` is likely to carry,
    `budget` tokens at most; `batch` is the step now running (its chunks count as computed)."""
    stepped = {id(seq): n for seq, n in batch.entries}
    order, bm = scheduler.policy.order, scheduler.block_manager
    prefilling = []
    for seq in order(scheduler.running):
        start = seq.num_computed_tokens + stepped.get(id(seq), 0)
        if seq.is_finished:
            continue
        if start >= seq.prompt_len:
            budget -= 1  # a decoding sequence's token
        else:
            prefilling.append((seq, start))
    # a waiting prompt starts past its cached prefix, as the scheduler will admit it
    prefilling += [(seq, max(seq.num_computed_tokens, bm.num_cached_tokens(seq))) for seq in order(scheduler.waiting)]
    out = []
    for seq, start in prefilling:
        if budget <= 0:
            break
        end = min(seq.prompt_len, start + budget)
        budget -= end - start
        held = seq.state.embeds
        out.extend((seq, item) for item in seq.state.vision
                   if item.offset < end and item.offset + item.num_tokens > start and item.content_hash not in held)
    return out
