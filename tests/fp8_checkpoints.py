"""Checkpoint directories holding FP8 projections in the layouts transformers and llm-compressor write,
made from a tiny zoo checkpoint: the language model's q/k/v/o, gate/up, down weights (cast to bf16, as
a bf16 engine loads them) quantized and stored with their scales; everything else as it was.

    fbgemm_fp8               weight fp8 [N, K], weight_scale [N, 1] fp32           (FbgemmFp8Linear)
    ct_channel / ct_tensor   weight fp8 [N, K], weight_scale [N, 1] / [1]          (compressed-tensors FP8-Dynamic)
    fp8_block / ct_block     weight fp8 [N, K], weight_scale(_inv) [ceil(N/bn), ceil(K/bk)]

Per-channel layouts use vlora_kernels.fp8.quantize_weight, so their bytes are exactly what the engine would
compute from the bf16 checkpoint itself.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vlora_kernels.fp8 import FP8_DTYPE, FP8_MAX, SCALE_FLOOR, quantize_weight

LM_PROJECTION = re.compile(r"(model\.language_model\.|model\.|language_model\.model\.)layers\.\d+\."
                           r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
BLOCK = (32, 48)  # ragged over the tiny model's K = 128 and 512: the last block column is partial


def _ct_group(strategy: str, block=None) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "group_size": None, "block_structure": list(block) if block else None, "observer": "minmax"}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
            "strategy": "group" if strategy == "block" else "token", "group_size": 128 if block else None}
    return {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None}


def quantization_config(layout: str) -> dict:
    """The config.json entry each layout's writer puts there (compressed-tensors by hand, from its format)."""
    if layout == "fbgemm_fp8":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": ["lm_head", "visual"]}
    if layout == "fp8_block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
                "modules_to_not_convert": ["lm_head", "visual"]}
    strategy = {"ct_channel": "channel", "ct_tensor": "tensor", "ct_block": "block"}[layout]
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": _ct_group(strategy, BLOCK if strategy == "block" else None)},
            "ignore": ["lm_head", "re:visual.*"], "kv_cache_scheme": None, "sparsity_config": {},
            "global_compression_ratio": None}


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() / FP8_MAX).clamp_min(SCALE_FLOOR)


def quantize(weight: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(fp8 weight, scale as stored, scale tensor's name) of a [N, K] weight in `layout`."""
    w = weight.to(torch.bfloat16).float()
    if layout in ("fbgemm_fp8", "ct_channel"):
        q, s = quantize_weight(w)
        return q, s[:, None], "weight_scale"
    if layout == "ct_tensor":
        s = _scale(w.abs().amax()).reshape(1)
        return (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s, "weight_scale"
    n, k = w.shape
    bn, bk = BLOCK
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w
    s = _scale(padded.abs().view(rows, bn, cols, bk).amax(dim=(1, 3)))  # [rows, cols]
    full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, s, ("weight_scale_inv" if layout == "fp8_block" else "weight_scale")


def write_fp8_checkpoint(src: str | Path, out: str | Path, layout: str, scale_dtype=torch.float32,
                         config: dict | None = None) -> Path:
    """Copies checkpoint `src` to `out` with its language-model projections stored as FP8 in `layout`;
    `config` replaces the quantization_config written to config.json."""
    src, out = Path(src), Path(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    stored = {}
    for name, tensor in tensors.items():
        if LM_PROJECTION.fullmatch(name):
            q, s, scale_name = quantize(tensor, layout)
            stored[name] = q
            stored[name[:-len("weight")] + scale_name] = s.to(scale_dtype)
        else:
            stored[name] = tensor
    save_file(stored, out / "model.safetensors")
    write_config(out, quantization_config(layout) if config is None else config)
    return out


def write_config(directory: Path, qc: dict | None) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.pop("quantization_config", None)
    if qc is not None:
        config["quantization_config"] = qc
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def stored_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    return load_file(Path(directory) / "model.safetensors")
