"""The cost profile of this engine on this device, measured at start (EngineConfig.profile = "measure").

Synthetic steps run through the model runner exactly as served steps do: the K/V cache is bound,
a decode-shaped step (one token per sequence) replays its CUDA graph on a GPU (the plain, LoRA or
mixture graph of its bucket), other steps run eagerly with the paged prefill kernel, and every
step ends with the LM head over its sampled rows. Decode sequences attend to `decode_context`
cached tokens each (blocks of the idle cache; nothing is served yet, so what they hold does not
matter); prefill sequences attend to their own tokens. The LoRA metadata of each op:

    "atmm"   unmerged: lora_tokens spread over lora_adapters resident adapters (the engine's operator)
    "delora" mixture: the first adapter is the merged one; the other tokens with their own adapter
             and the merged one negated, in one call (serve/lora/modes.py)
    "einsum" unmerged through dLoRA's einsum operator (vlora_kernels.lora_einsum; eager, no graph)

Switches: "atmm" is one fold with the engine's switch method (the one-shot Triton kernel on GPU,
per-layer fp32 addmm on CPU), "addmm" the per-layer fold. They are timed as merge + unmerge round
trips on the real weights, which are copied first and restored after, so no rounding drift is left.
The LoRA steps need adapters: the ones loaded at start (cycled when a shape asks for more).
The engine's own per-step work (scheduling, input building, sampling) is not in these times.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from serve.lora.metadata import build_lora_batch
from serve.lora.modes import build_mixture_batch
from serve.orchestrator import CostProfile, ProfileShapes, StepShape, measure_profile
from serve.orchestrator.profile import paired_delta_ms, time_call_ms

from serve.forward.context import StepContext
from .inputs import StepInputs

# a CPU-sized grid (the tiny zoo); GPUs use ProfileShapes' defaults
CPU_SHAPES = dict(seqs=[1, 4], tokens=[1, 16, 64], adapters=[1, 2], lora_ops=["atmm", "delora", "einsum"],
                  switch_ops=["atmm", "addmm"])


def default_shapes(device: torch.device) -> ProfileShapes:
    if device.type == "cuda":
        return ProfileShapes(lora_ops=["atmm", "delora", "einsum"], switch_ops=["atmm", "addmm"])
    return ProfileShapes(**CPU_SHAPES)


def synthetic_inputs(runner, shape: StepShape, decode_context: int) -> StepInputs:
    """A step of `shape.seqs` sequences and `shape.tokens` tokens over the runner's cache (no LoRA yet)."""
    device, cache, model = runner.device, runner.kv_cache, runner.model
    t, s = shape.tokens, max(1, min(shape.seqs, shape.tokens))
    query = [t // s + (i < t % s) for i in range(s)]
    decode = t == s
    context = [min(decode_context, runner.max_model_len) if decode else n for n in query]
    bs = cache.block_size
    per_seq = -(-max(context) // bs)
    tables = [[(i * per_seq + j) % cache.num_blocks for j in range(per_seq)] for i in range(s)]
    slots, positions = [], []
    for table, n, length in zip(tables, query, context):
        for p in range(length - n, length):
            slots.append(table[p // bs] * bs + p % bs)
            positions.append(p)
    starts = [0]
    for n in query:
        starts.append(starts[-1] + n)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    ctx = StepContext(tensor(slots, torch.int64), tensor(starts, torch.int32), tensor(context, torch.int32),
                      tensor(tables, torch.int32), max(query), max(context), decode, query_lens_list=query,
                      context_lens_list=context)
    pos = tensor(positions, torch.int64)
    if model.mrope:
        pos = pos.expand(3, -1).contiguous()
    return StepInputs(torch.zeros(t, dtype=torch.int64, device=device), pos, ctx, [e - 1 for e in starts[1:]], [])


def _resident_slots(manager, limit: int | None = None) -> list[int]:
    """Pool slots of the adapters loaded at start (at most `limit`), waiting for pending swap-ins."""
    names = list(manager.records)
    if not names:
        raise ValueError("profile='measure' needs adapters loaded at start (EngineConfig.adapters or "
                         "adapter_manifest) to time the LoRA work; or use profile='assumed' / a JSON path")
    slots = []
    for n in names[:limit] or names[:1]:
        if manager.ready(n) or (manager.wait_pending() and manager.ready(n)):
            slots.append(manager.get(n).slot)
    return slots


@contextmanager
def _unserved(runner):
    """Steps run inside are timing runs, not served steps: the runner's counters are put back."""
    counters = dict(runner.counters)
    try:
        yield
    finally:
        runner.counters.update(counters)


@torch.no_grad()
def _run_step(runner, shape: StepShape, lora, decode_context: int) -> None:
    """One synthetic step of `shape` with LoRA metadata `lora` through the runner, LM head included,
    waited for."""
    inputs = synthetic_inputs(runner, shape, decode_context)
    inputs.context.lora = lora
    hidden = runner._forward(inputs)
    runner.model.compute_logits(hidden[inputs.sample_rows])
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def _step_fn(runner, manager, slots: list[int], decode_context: int):
    """step(shape): one synthetic step of `shape`, with the LoRA work its op and counts ask for."""
    device = runner.device

    def step(shape: StepShape) -> None:
        t, lora = shape.tokens, None
        if shape.lora_op is not None:
            k = max(1, shape.lora_adapters)
            if shape.lora_op == "delora":
                merged, own = slots[0], [slots[i % len(slots)] for i in range(1, k)] or [-1]
                slot_ids = [own[i % len(own)] for i in range(shape.lora_tokens)] + [-1] * (t - shape.lora_tokens)
                lora = build_mixture_batch(slot_ids, merged, device, manager.configured_backend)
            else:
                own = [slots[i % len(slots)] for i in range(k)]
                slot_ids = [own[i % k] for i in range(shape.lora_tokens)] + [-1] * (t - shape.lora_tokens)
                backend = "einsum" if shape.lora_op == "einsum" else manager.configured_backend
                lora = build_lora_batch(slot_ids, device, backend)
        _run_step(runner, shape, lora, decode_context)

    return step


def measure_engine_profile(runner, manager, shapes: ProfileShapes | None = None, name: str = "measured",
                           progress=None, warmup: int = 2, repeats: int = 5,
                           decode_context: int = 512) -> CostProfile:
    """runner: the engine's ModelRunner (cache bound, graphs captured); manager: AdapterManager with
    modes enabled and at least one adapter loaded."""
    device = runner.device
    shapes = shapes or default_shapes(device)
    slots = _resident_slots(manager, manager.config.slots - 1)
    step = _step_fn(runner, manager, slots, decode_context)
    merger = manager.merger

    def switch(op: str) -> None:  # a round trip: measure_profile halves it
        method = merger.method if op == "atmm" else "addmm"
        merger.fold(slots[0], +1, method)
        merger.fold(slots[0], -1, method)

    saved = merger.snapshot()
    try:
        with _unserved(runner):
            return measure_profile(step, switch, shapes, warmup=warmup, repeats=repeats, name=name,
                                   device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                   model=type(runner.model).__name__, progress=progress)
    finally:
        merger.restore(saved)


def time_mode_steps(runner, manager, seqs: int, tokens: int, others: int, adapters: int, *,
                    warmup: int = 3, repeats: int = 10, decode_context: int = 512) -> dict[str, float]:
    """One step of `seqs` sequences and `tokens` tokens in which `others` tokens belong to adapters
    other than the batch's most requested one (spread over `adapters` - 1 adapters) and the rest to
    it, timed (median ms) as served in each mode:

        plain     no LoRA work (every token of the merged adapter: merge mode)
        unmerge   every token through ATMM
        mixture   the top adapter merged, the `others` tokens through deLoRA (one LoRA call)

    The extra LoRA work of mixture over that of unmerge is (mixture - plain) / (unmerge - plain)."""
    slots = _resident_slots(manager, max(2, adapters))
    if len(slots) < 2:
        raise ValueError("timing mixture steps needs at least two resident adapters")
    if tokens % seqs or others % (tokens // seqs) or others > tokens:
        raise ValueError(f"tokens ({tokens}) must split evenly over seqs ({seqs}) and others ({others}) "
                         "must be whole sequences of them")
    top, rest = slots[0], slots[1:max(2, adapters)]
    per_seq, n_other = tokens // seqs, others // (tokens // seqs)  # the first n_other sequences: other adapters
    slot_ids = [rest[(i // per_seq) % len(rest)] if i // per_seq < n_other else top for i in range(tokens)]
    device, shape = runner.device, StepShape(seqs, tokens)
    backend = manager.configured_backend
    batches = {"unmerge": build_lora_batch(slot_ids, device, backend),
               "mixture": build_mixture_batch(slot_ids, top, device, backend)}

    plain = functools.partial(_run_step, runner, shape, None, decode_context)
    out = {}
    with _unserved(runner):
        out["plain"] = time_call_ms(plain, warmup, repeats)
        for mode, lora in batches.items():  # each as plain + a paired difference (see paired_delta_ms)
            step = functools.partial(_run_step, runner, shape, lora, decode_context)
            out[mode] = out["plain"] + paired_delta_ms(plain, step, warmup, repeats)
    return out
