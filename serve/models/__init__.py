"""Serving models: our own language side of Qwen2-VL / Qwen2.5-VL / LLaVA-1.5 over the paged cache,
the transformers vision towers with the checkpoint's weights, and prompt processing.

    model, processor = load_model("zoo/qwen2_vl_tiny", dtype="float32", device="cpu")
    prompt = processor.process(prompt="How many cars?", images=[image])  # token ids + vision inputs
    hidden = model(input_ids, positions, mm_embeds, mm_mask)             # inside a StepContext

Projection hook points for adapters: `model.language_model.projections()` yields
(layer, name, module) for qkv_proj / o_proj / gate_up_proj / down_proj (slice layout in layers.py);
`set_projection(layer, name, module)` replaces one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from .args import ModelArgs, read_model_args
from .decoder import PROJECTIONS, DecoderModel
from .layers import Linear, RMSNorm
from .llava import LlavaForServing
from .loader import WeightSource
from .processing import ProcessedPrompt, PromptProcessor, content_hash
from .qwen2_vl import Qwen2VLForServing
from .random_weights import RandomWeights
from .rope import RotaryEmbedding, VisionGrid, mrope_prompt_positions
from .vision import VisionInput
from .vlm import VisionLanguageModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, args: ModelArgs) -> torch.dtype:
    name = args.dtype if name == "auto" else name
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES) + ['auto']}")
    return DTYPES[name]


def load_model(path: str | Path, dtype: str = "auto", device="cpu", attention_backend: str = "torch",
               weights: Mapping[str, torch.Tensor] | None = None, pixels: str = "host", quantization: str = "none",
               tp=None, tp_vision: str = "split"):
    """(VisionLanguageModel, PromptProcessor) of a Hugging Face checkpoint directory.

    weights: tensors to load instead of the directory's safetensors (e.g. the state dict of a
    transformers model built in memory, or random_weights.RandomWeights, which makes each on demand);
    the directory then needs only config and processor files.
    pixels: where Qwen pixel rows are prepared, "host" or "device" (see PromptProcessor).
    quantization: "fp8" quantizes the language model's projections once, after loading (fp8.py); a
    checkpoint that holds FP8 projections (fp8_checkpoint.py) keeps its bytes, or is dequantized with "none".
    tp: a parallel.TPGroup: only this rank's shard is built and read (parallel.py), the vision tower
    run as `tp_vision` says; the result equals the whole model loaded, then `shard_model`.
    """
    from transformers import AutoProcessor

    from .fp8_checkpoint import inspect_checkpoint

    if tp is not None and quantization != "none":
        raise ValueError(f"quantization={quantization!r} under tensor parallel is not supported: shard bf16 weights")
    args, hf_config = read_model_args(path)
    torch_dtype = resolve_dtype(dtype, args)
    source = WeightSource(tensors=weights) if weights is not None else WeightSource.from_dir(path)
    # FP8 weights the engine cannot serve are refused here, from headers, before the model is built
    fp8_checkpoint = inspect_checkpoint(path, source, quantization, torch_dtype)
    cls = LlavaForServing if args.arch == "llava" else Qwen2VLForServing
    model = cls(args, hf_config, attention_backend, torch_dtype, device, tp=tp, tp_vision=tp_vision)
    with torch.no_grad():
        if fp8_checkpoint is not None and quantization == "fp8":
            from .fp8 import prepare_fp8_projections

            prepare_fp8_projections(model.language_model)  # the stored FP8 bytes load as they are
        model.load(source)
        if quantization == "fp8":
            from .fp8 import quantize_projections

            quantize_projections(model.language_model)
    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    return model.eval(), PromptProcessor(processor, args, pixels)


__all__ = [
    "ModelArgs", "read_model_args", "load_model", "resolve_dtype", "DTYPES", "VisionLanguageModel",
    "Qwen2VLForServing", "LlavaForServing", "DecoderModel", "PROJECTIONS", "Linear", "RMSNorm",
    "RotaryEmbedding", "VisionGrid", "mrope_prompt_positions", "VisionInput", "ProcessedPrompt",
    "PromptProcessor", "content_hash", "WeightSource", "RandomWeights",
]
