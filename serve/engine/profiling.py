"""The cost profile of this engine on this device, measured at start (EngineConfig.profile = "measure").

Synthetic steps of the language model (no K/V cache yet: measured before the runner sizes and
binds it, prefill-shaped attention over `seqs` sequences of equal length, no CUDA graphs) with the
LoRA metadata of each op, timed by serve.orchestrator.measure_profile:

    "atmm"   unmerged: lora_tokens spread over lora_adapters resident adapters (the engine's operator)
    "delora" mixture: the first adapter is the merged one; the other tokens' own pass plus the
             negative pass of the merged slot (serve/lora/modes.py)
    "einsum" unmerged through the plain PyTorch per-segment operator (kernels.lora_reference)

Switches: "atmm" is one fold with the engine's switch method (the one-shot Triton kernel on GPU,
per-layer fp32 addmm on CPU), "addmm" the per-layer fold. They are timed as merge + unmerge round
trips on the real weights, which are copied first and restored after, so no rounding drift is left.
The LoRA steps need adapters: the ones loaded at start (cycled when a shape asks for more).
"""

from __future__ import annotations

import torch

from serve.lora.metadata import build_lora_batch
from serve.lora.modes import build_mixture_batch
from serve.orchestrator import CostProfile, ProfileShapes, StepShape, measure_profile

from .context import StepContext, step_context

# a CPU-sized grid (the tiny zoo); GPUs use ProfileShapes' defaults
CPU_SHAPES = dict(seqs=[1, 4], tokens=[1, 16, 64], adapters=[1, 2], lora_ops=["atmm", "delora"],
                  switch_ops=["atmm", "addmm"])


def default_shapes(device: torch.device) -> ProfileShapes:
    if device.type == "cuda":
        return ProfileShapes(switch_ops=["atmm", "addmm"])
    return ProfileShapes(**CPU_SHAPES)


def _positions(model, lens: list[int], device) -> torch.Tensor:
    pos = torch.cat([torch.arange(n, device=device) for n in lens])
    return pos.expand(3, -1).contiguous() if model.mrope else pos


def measure_engine_profile(model, manager, device: torch.device, shapes: ProfileShapes | None = None,
                           name: str = "measured", progress=None, warmup: int = 1, repeats: int = 3) -> CostProfile:
    """model: serve.models VisionLanguageModel (K/V cache not bound yet); manager: AdapterManager with
    modes enabled and at least one adapter loaded."""
    shapes = shapes or default_shapes(device)
    names = list(manager.records)
    if not names:
        raise ValueError("profile='measure' needs adapters loaded at start (EngineConfig.adapters or "
                         "adapter_manifest) to time the LoRA work; or use profile='assumed' / a JSON path")
    slots = []
    for n in names[:manager.config.slots - 1] or names[:1]:
        if manager.ready(n) or (manager.wait_pending() and manager.ready(n)):
            slots.append(manager.get(n).slot)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)

    @torch.no_grad()
    def step(shape: StepShape) -> None:
        t, s = shape.tokens, max(1, min(shape.seqs, shape.tokens))
        lens = [t // s + (i < t % s) for i in range(s)]
        ids = torch.zeros(t, dtype=torch.int64, device=device)
        ctx = StepContext(None, None, None, None, max(lens), max(lens), False, query_lens_list=lens,
                          context_lens_list=lens)
        if shape.lora_op is not None:
            k = max(1, shape.lora_adapters)
            if shape.lora_op == "delora":
                merged, own = slots[0], [slots[i % len(slots)] for i in range(1, k)] or [-1]
                slot_ids = [own[i % len(own)] for i in range(shape.lora_tokens)] + [-1] * (t - shape.lora_tokens)
                ctx.lora = build_mixture_batch(slot_ids, merged, device, manager.backend)
            else:
                own = [slots[i % len(slots)] for i in range(k)]
                slot_ids = [own[i % k] for i in range(shape.lora_tokens)] + [-1] * (t - shape.lora_tokens)
                backend = "torch" if shape.lora_op == "einsum" else manager.backend
                ctx.lora = build_lora_batch(slot_ids, device, backend)
        with step_context(ctx):
            model(ids, _positions(model, lens, device))
        sync(device)

    merger = manager.merger

    def switch(op: str) -> None:  # a round trip: measure_profile halves it
        method = merger.method if op == "atmm" else "addmm"
        merger.fold(slots[0], +1, method)
        merger.fold(slots[0], -1, method)

    saved = merger.snapshot()
    try:
        return measure_profile(step, switch, shapes, warmup=warmup, repeats=repeats, name=name,
                               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                               model=type(model).__name__, progress=progress)
    finally:
        merger.restore(saved)
