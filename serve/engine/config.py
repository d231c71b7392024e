"""The engine's configuration: one plain dataclass (Hydra stays at the entry points).

Field names match the `engine:` block of conf/serve.yaml; `EngineConfig.from_dict` ignores keys
this engine does not use.

Orchestration (serve/engine/planner.py): `policy` names a policy of serve.orchestrator's
registry. "fcfs" (the default) keeps the plain first-come-first-served scheduler with every
adapter unmerged, and no orchestrator runs; the others (v_lora, merge_only, unmerge_only, dlora)
decide the mode and the batch every step, with `policy_params` (the fields of the policy's config
dataclass, i.e. conf/orchestrator/<name>.yaml) and the cost profile named by `profile`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .anticipation import check_anticipate_ms
from .scheduler import check_quiet_rate, check_waiting_window


@dataclass
class EngineConfig:
    device: str = "auto"  # "auto" (cuda when available, else cpu), "cpu", "cuda", "cuda:1"
    dtype: str = "auto"  # "auto" = the checkpoint's dtype, or float32 / bfloat16 / float16
    # "fp8": the language model's projections quantized once at load (serve/models/fp8.py); needs a
    # GPU of compute capability >= 8.9, refused elsewhere at start. "none": the checkpoint's dtype
    quantization: str = "none"
    # with quantization "fp8": the LM head's weight in FP8 too (per vocabulary row), for the logits of every step
    # (serve/models/fp8.py quantize_lm_head); its bf16 weight is kept (a tied head is the embedding table)
    fp8_lm_head: bool = False
    max_batch_size: int = 32  # sequences per step
    max_tokens_per_step: int = 4096  # token budget per step (prefill chunks + decode tokens)
    kv_block_size: int = 16
    gpu_memory_fraction: float = 0.85  # of the whole device, for weights + activations + K/V cache
    num_kv_blocks: int | None = None  # fixed cache size; default on CPU: 512 blocks, on GPU: from the budget
    attention_backend: str = "auto"  # "auto" (triton on GPU, torch on CPU), "torch", "triton"
    chunked_prefill: bool = True
    # prompt tokens per step while some request is decoding (None: all of max_tokens_per_step): caps
    # how long each generated token waits behind other requests' prefill (video chunks: ~800 each)
    # 0: a decode lane (decode-only steps while anyone decodes; after `decode_burst` of them in a row
    # while prompts wait, one step with the whole budget: serve/engine/scheduler.py)
    max_prefill_with_decode: int | None = None
    decode_burst: int = 16
    # while tenants share a step, one over its share of the batch carries at most the others' tokens
    # per weight (serve/engine/tenancy.py step_caps); False: the step is work-conserving
    tenant_step_cap: bool = True
    # with the cap: a step carrying prompt tokens of a tenant within its share carries none of the tenants
    # over theirs; False: they carry up to the others' prompt tokens. Off by default: on 2 CPU cores it did
    # not lower the soak's ratios (results/soak/cpu/quiet_steps), on an H100 at rate 1 a little, for 19-29% of a
    # flood's requests (results/soak/nvidia_h100/quiet_steps)
    tenant_quiet_prefill: bool = False
    # quiet steps earned per step that is not one: at most rate / (1 + rate) of the steps are quiet (0.5: a
    # third, 1: a half; serve/engine/scheduler.py)
    tenant_quiet_rate: float = 0.5
    # with the cap: one over its share also runs at most the others' per-weight count of sequences in a step, or
    # one per SEQ_TOKENS of their tokens if more (serve/engine/tenancy.py step_caps' `seq_cap`); False: any number,
    # within its tokens
    tenant_seq_cap: bool = True
    # waiting requests of one tenant each step looks at, its earliest (serve/engine/scheduler.py): the rest
    # wait in its backlog, so a step's cost does not grow with a queue of thousands; None: all
    waiting_window: int | None = 64
    # ms a step may wait for a tenant about to send its next request, after its last one finished while
    # others have work (serve/engine/anticipation.py); None: never wait
    anticipate_ms: float | None = 20.0
    enable_prefix_cache: bool = True
    encoder_cache_items: int = 64  # vision-encoder outputs kept by image hash (0 = off)
    max_vision_batch: int = 64  # images / clips / frame groups per vision-tower call (one packed pass each)
    # Qwen pixel preprocessing: "host" (the processor, on the request's thread), "device" (frames stay
    # uint8 / JPEG until the tower's device resizes, normalises and patchifies them in one batch),
    # "auto" (device on a GPU, host on the CPU)
    pixels: str = "auto"
    vision_attention: str = "auto"  # vision towers' segment attention: auto | varlen | batched
    vision_compile: bool = True  # GPU: the tower's elementwise chains compiled, at start (off: eager)
    max_model_len: int | None = None  # default: the model's limit, capped by the cache size
    cuda_graphs: bool = True  # decode steps replay graphs captured per batch-size bucket (GPU)
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    # decode graphs with adapters: besides each bucket's graph for any mix (gridded for as many
    # adapters as tokens, tiled for one adapter across the batch), one per pair of bounds here,
    # replayed when the step uses at most that many adapters (segments) with at most that many
    # tokens each (seg_lens), gridded and tiled for that mix (e.g. seg_lens (1,): all distinct).
    # (1, 8) each: 1.16x against 1.25-1.28x the no-adapter step for one rank-64 adapter at batch
    # 32, 1.68-1.74x against 1.98-2.07x for 32 distinct (results/kernels/mix_keyed_h100/); () turns it off
    lora_graph_segments: tuple[int, ...] = (1, 8)
    lora_graph_seg_lens: tuple[int, ...] = (1, 8)
    policy: str = "fcfs"  # serve.orchestrator policy: fcfs | v_lora | merge_only | unmerge_only | dlora
    policy_params: dict | None = None  # fields of the policy's config dataclass
    profile: str = "assumed"  # cost profile: "assumed" (serve.orchestrator's default), "measure" (at start), or a JSON path
    profile_shapes: dict | None = None  # serve.orchestrator.ProfileShapes fields for profile="measure"
    switch_method: str = "auto"  # merge kernel: "auto" (one_shot on GPU, addmm on CPU), "one_shot" (Triton), "addmm"
    seed: int = 0  # the generator of sampled requests without their own seed
    # made-up traffic through every shape before the server takes work (serve/engine/warmup.py):
    # "auto" on a GPU only, "on", "off"
    warm_up: str = "auto"
    # the warm-up's made-up pictures: chunks of `warm_up_frames` square frames of `warm_up_side` pixels
    # (set them to your cameras': the vision tower's packs and the prompts' lengths follow the picture)
    warm_up_side: int = 448
    warm_up_frames: int = 6
    # more camera sizes, (width, height) each (or "WxH"), whose tower shapes the warm-up also runs, so a
    # 16:9 camera's steps find their attention plans made (the waves' token shapes do not depend on them)
    warm_up_sizes: tuple = ()
    # the next step's pictures encoded while the current step runs on the device, before the host waits
    # for it (serve/engine/lookahead.py): "auto" on a GPU only (on the CPU the work only moves), "on", "off".
    # Off with tensor parallelism (every rank must run the same tower calls)
    encode_ahead: str = "auto"
    # > 1: this process is one rank of a tensor-parallel group (serve.distributed); torch.distributed
    # must be initialised with this world size, and every rank gets the same requests and calls
    tensor_parallel_size: int = 1
    # the vision tower under tensor parallelism (serve/models/parallel.py SplitVision): "split", each rank
    # encodes its share of a step's items and one all-gather shares the embeddings; "whole", every rank
    # encodes every item, no collective. `vlora bench bench.suite=tp` times both (docs/scale_out.md)
    tp_vision: str = "split"
    # adapters (serve/lora): the pool is allocated at start; adapter_slots=0 serves the base model only
    adapter_slots: int = 8  # adapters resident on the device at once
    host_adapter_cache: int = 64  # adapters whose weights stay in (pinned) host memory
    max_lora_rank: int = 64  # largest adapter rank; sets the pool's size with the slots and targets
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lora_backend: str = "auto"  # "auto" (ATMM Triton kernels on GPU in fp16/bf16, PyTorch otherwise), "triton", "torch"
    # GPU, triton backend: each LoRA'd projection's shrink runs on a side stream while its base
    # matmul runs, leaving the chain of dependent kernels (vlora_kernels.add_lora_beside). Off: at batch
    # 32 it measured within the run-to-run spread of the plain order (results/kernels/mix_keyed_h100/)
    lora_overlap_shrink: bool = False
    # slots for the vision tower's projections (serve/lora/tower.py): adapters trained with
    # train_vision_tower are served; off saves their share of the pool (7B, rank 64: ~84 MB a slot)
    # and such adapters are refused at load
    tower_lora: bool = True
    adapters: tuple[str, ...] = ()  # PEFT directories loaded at start: "path" (named after its folder) or "name=path"
    adapter_manifest: str | None = None  # a fusion manifest (file or folder) whose adapters load at start
    pinned_adapters: tuple[str, ...] = ()  # names kept resident once loaded

    def __post_init__(self) -> None:
        if self.kv_block_size < 1 or self.max_batch_size < 1 or self.max_tokens_per_step < 1:
            raise ValueError("kv_block_size, max_batch_size and max_tokens_per_step must be >= 1")
        if self.pixels not in ("auto", "host", "device"):
            raise ValueError(f"pixels {self.pixels!r} is not one of auto, host, device")
        if self.vision_attention not in ("auto", "varlen", "batched"):
            raise ValueError(f"vision_attention {self.vision_attention!r} is not one of auto, varlen, batched")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend {self.attention_backend!r} is not one of auto, torch, triton")
        self.graph_batch_sizes = tuple(sorted(set(int(b) for b in self.graph_batch_sizes)))
        for name in ("lora_graph_segments", "lora_graph_seg_lens"):
            bounds = tuple(sorted(set(int(n) for n in getattr(self, name))))
            if any(n < 1 for n in bounds):
                raise ValueError(f"{name} must be bounds >= 1, got {bounds}")
            setattr(self, name, bounds)
        if self.warm_up not in ("auto", "on", "off"):
            raise ValueError(f"warm_up={self.warm_up!r}: use auto (on a GPU only), on or off")
        if self.warm_up_side < 28 or self.warm_up_frames < 1:
            raise ValueError(f"warm_up_side={self.warm_up_side} and warm_up_frames={self.warm_up_frames}: give a side "
                             "of at least 28 pixels and at least one frame")
        self.warm_up_sizes = tuple(_picture_size(size) for size in self.warm_up_sizes)
        check_quiet_rate(self.tenant_quiet_rate)
        if self.encode_ahead not in ("auto", "on", "off"):
            raise ValueError(f"encode_ahead={self.encode_ahead!r}: use auto (on a GPU only), on or off")
        if self.adapter_slots < 0:
            raise ValueError(f"adapter_slots must be >= 0 (0 = no adapters), got {self.adapter_slots}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tp_vision not in ("split", "whole"):  # serve.models.parallel.VISION_MODES
            raise ValueError(f"tp_vision={self.tp_vision!r}: use split (each rank encodes its share of the "
                             "items, then one all-gather) or whole (every rank encodes every item)")
        self.quantization = self.quantization or "none"  # a YAML null
        if self.quantization not in ("none", "fp8"):
            raise ValueError(f"quantization={self.quantization!r} is not one of none, fp8")
        if self.quantization == "fp8" and self.tensor_parallel_size > 1:
            raise ValueError("quantization=fp8 with tensor_parallel_size > 1 is not supported: shard bf16 weights")
        check_waiting_window(self.waiting_window)
        check_anticipate_ms(self.anticipate_ms)
        if self.fp8_lm_head and self.quantization != "fp8":
            raise ValueError(f"fp8_lm_head=true needs quantization=fp8, got quantization={self.quantization}")
        for name in ("lora_targets", "adapters", "pinned_adapters"):  # a lone string is one entry, not characters
            value = getattr(self, name)
            setattr(self, name, (value,) if isinstance(value, str) else tuple(value))

    @classmethod
    def from_dict(cls, values: dict) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in values.items() if k in names}
        if isinstance(kept.get("policy"), dict):  # a whole conf/orchestrator group: name + params
            params = dict(kept.pop("policy"))
            kept["policy"] = params.pop("name")
            kept.setdefault("policy_params", params)
        elif kept.get("policy") not in (None, "fcfs") and "policy_params" not in kept:
            # a bare name (conf/serve.yaml's `policy: v_lora`) keeps the server on fcfs until the
            # serve entry point passes the policy group; give policy_params (or the group) to opt in
            kept.pop("policy")
        for key in ("graph_batch_sizes", "lora_graph_segments", "lora_graph_seg_lens", "lora_targets", "adapters",
                    "pinned_adapters"):
            if key in kept and not isinstance(kept[key], str):
                kept[key] = tuple(kept[key])
        return cls(**kept)


def _picture_size(size) -> tuple[int, int]:
    """(width, height) of a warm-up picture given as a pair or "WxH", each side at least 28 pixels."""
    try:
        pair = tuple(int(v) for v in (size.lower().split("x") if isinstance(size, str) else size))
    except (TypeError, ValueError):
        pair = ()
    if len(pair) != 2 or min(pair) < 28:
        raise ValueError(f"warm_up_sizes: {size!r} is not a width x height of at least 28 pixels each "
                         "(give [width, height] or \"WxH\")")
    return pair
