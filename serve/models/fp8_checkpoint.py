"""Checkpoints that already hold FP8 weights: their `quantization_config` read, checked and loaded.

Served layouts (what transformers and llm-compressor write for the language model's projections):

    fbgemm_fp8                    weight [N, K] float8_e4m3fn, weight_scale [N, 1]      exact
    compressed-tensors, channel   weight [N, K] float8_e4m3fn, weight_scale [N, 1]      exact
    compressed-tensors, tensor    weight [N, K] float8_e4m3fn, weight_scale [1]         exact (broadcast to [N])
    fp8 (FineGrainedFP8), block   weight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/bn), ceil(K/bk)]
                                  dequantized and requantized per output channel at load (one more rounding)

Our FP8 projection holds W ~= q * s[:, None] with one fp32 scale per output row, so the per-channel
and per-tensor layouts load byte for byte: a fused projection (q|k|v, gate|up) stacks each part's
rows and their scales along N. Everything else (other methods, e5m2, static activation scales, a
KV-cache scheme, FP8 outside the language model's projections) is refused before the model is
built, with one line naming what. Without `quantization=fp8` the FP8 weights are dequantized to the
engine's dtype at load (so such a checkpoint also runs on the CPU, older GPUs and tensor parallel).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from vlora_kernels.fp8 import FP8_DTYPE, dequantize, quantize_weight

from .fp8 import Fp8Linear
from .loader import is_fp8_dtype

log = logging.getLogger(__name__)

METHODS = ("fbgemm_fp8", "compressed-tensors", "fp8")
# a projection of the language model, relative to its prefix (loader.TEXT_PREFIXES)
PROJECTION = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)")
# tensors that only a quantized layer holds; where one sits decides whether we can serve it
QUANT_LEAVES = ("weight_scale", "weight_scale_inv", "input_scale", "activation_scale", "input_scale_ub",
                "weight_zero_point", "input_zero_point", "output_scale", "k_scale", "v_scale", "weight_g_idx")


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How a checkpoint stores its FP8 projections."""
    method: str  # quantization_config.quant_method
    scale_name: str  # "weight_scale" (per channel or per tensor) or "weight_scale_inv" (per block)
    block: tuple[int, int] | None = None  # (rows, columns) of one scale's block; None: channel / tensor

    def describe(self) -> str:
        return f"{self.method} ({'block ' + 'x'.join(map(str, self.block)) if self.block else 'per channel'})"


def _refuse(path, what: str):
    raise ValueError(f"{path}: {what}")


def read_fp8_checkpoint(path: str | Path) -> Fp8Checkpoint | None:
    """The FP8 layout named by config.json's quantization_config, None without one; ValueError (one
    line) for anything we cannot serve as it is stored."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    where = f"{config_file} quantization_config"
    if method == "fbgemm_fp8":
        # activation_scale_ub caps a token's amax in fbgemm's kernel; our per-token scale is never
        # capped, which gives the same scales whenever a token's amax is below the cap (1200 by default)
        return Fp8Checkpoint(method, "weight_scale")
    if method == "fp8":
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            _refuse(where, f"activation_scheme={qc['activation_scheme']!r} (static activation scales) is not "
                           "served: the engine scales activations per token")
        block = qc.get("weight_block_size")
        if block is None:  # per-tensor FineGrainedFP8: weight_scale_inv holds one scale
            return Fp8Checkpoint(method, "weight_scale_inv", None)
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(int(b) > 0 for b in block)):
            _refuse(where, f"weight_block_size={block!r} is not two positive sizes")
        return Fp8Checkpoint(method, "weight_scale_inv", (int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    _refuse(where, f"quant_method={method!r} is not served; supported: {', '.join(METHODS)} (FP8 e4m3 weights)")


def _compressed_tensors(qc: dict, where: str) -> Fp8Checkpoint:
    if qc.get("format") != "float-quantized":
        _refuse(where, f"format={qc.get('format')!r} is not served; compressed-tensors FP8 is 'float-quantized'")
    if qc.get("quantization_status", "compressed") != "compressed":
        _refuse(where, f"quantization_status={qc['quantization_status']!r}: only 'compressed' weights are stored as FP8")
    for field in ("kv_cache_scheme", "transform_config"):
        if qc.get(field):
            _refuse(where, f"{field} is set: the engine keeps its KV cache and weights without it")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        _refuse(where, f"sparsity_config.format={sparsity['format']!r} is not served")
    groups = qc.get("config_groups") or {}
    if not groups:
        _refuse(where, "config_groups is empty")
    strategies = set()
    for name, group in groups.items():
        w = group.get("weights") or {}
        at = f"config_groups.{name}"
        if (w.get("type"), w.get("num_bits")) != ("float", 8):
            _refuse(where, f"{at}.weights is {w.get('type')} {w.get('num_bits')}-bit; only float 8-bit (FP8) is served")
        if not w.get("symmetric", True) or w.get("dynamic"):
            _refuse(where, f"{at}.weights must be symmetric and static (stored scales)")
        if w.get("strategy") not in ("channel", "tensor", "block"):
            _refuse(where, f"{at}.weights.strategy={w.get('strategy')!r} is not served; channel, tensor or block")
        if w["strategy"] == "block" and len(w.get("block_structure") or []) != 2:
            _refuse(where, f"{at}.weights.block_structure={w.get('block_structure')!r} is not two sizes")
        strategies.add((w["strategy"], tuple(w.get("block_structure") or ()) if w["strategy"] == "block" else ()))
        a = group.get("input_activations")
        if a is not None:
            if not a.get("dynamic"):
                _refuse(where, f"{at}.input_activations has static scales (dynamic=false); the engine scales "
                               "activations per token on the fly")
            if (a.get("type"), a.get("num_bits")) != ("float", 8):
                _refuse(where, f"{at}.input_activations is {a.get('type')} {a.get('num_bits')}-bit, not FP8")
        if group.get("output_activations"):
            _refuse(where, f"{at}.output_activations is set; not served")
    blocks = {s for s in strategies if s[0] == "block"}
    if blocks and len(strategies) > 1:
        _refuse(where, f"config_groups mix weight strategies {sorted(s[0] for s in strategies)}")
    if blocks:
        rows, cols = next(iter(blocks))[1]
        return Fp8Checkpoint("compressed-tensors", "weight_scale", (int(rows), int(cols)))
    return Fp8Checkpoint("compressed-tensors", "weight_scale")  # channel and tensor: both [N, 1] or [1]


def check_fp8_tensors(source, spec: Fp8Checkpoint | None, text_prefix: str | None, path) -> int:
    """Refuses (ValueError, one line) FP8 data the engine cannot serve, from tensor headers only (before
    the model is built): FP8 or quantization tensors outside the language model's projections, e5m2,
    static activation scales, a projection's FP8 weight without its scale. Returns the FP8 weights found."""
    count = 0
    for name in source.names():
        module, _, leaf = name.rpartition(".")
        dtype, shape = source.header(name)
        fp8 = is_fp8_dtype(dtype)
        if not fp8 and leaf not in QUANT_LEAVES:
            continue
        rel = module[len(text_prefix):] if text_prefix and module.startswith(text_prefix) else None
        if rel is None or not PROJECTION.fullmatch(rel):
            _refuse(path, f"tensor {name} ({dtype}) is quantized, but only the language model's q/k/v/o, gate/up "
                          "and down projections are served in FP8 (keep this layer in the checkpoint's dtype)")
        if leaf in ("input_scale", "activation_scale", "input_scale_ub", "input_zero_point"):
            _refuse(path, f"tensor {name}: static activation scales are not served (activations are scaled "
                          "per token)")
        if leaf != "weight" and leaf not in ("weight_scale", "weight_scale_inv"):
            _refuse(path, f"tensor {name}: {leaf} is not served (symmetric FP8 weight scales only)")
        if leaf == "weight" and fp8:
            if dtype not in ("F8_E4M3", str(FP8_DTYPE)):
                _refuse(path, f"tensor {name} is {dtype}; only float8_e4m3fn weights are served")
            if spec is None:
                _refuse(path, f"tensor {name} is FP8 but config.json has no quantization_config naming its scales")
            if f"{module}.{spec.scale_name}" not in source:
                _refuse(path, f"tensor {name} is FP8 but {module}.{spec.scale_name} ({spec.method}) is missing")
            _check_scale_shape(spec, shape, source.header(f"{module}.{spec.scale_name}")[1], module, path)
            count += 1
    return count


def _check_scale_shape(spec: Fp8Checkpoint, wshape, sshape, module: str, path) -> None:
    n, k = wshape
    numel = math.prod(sshape)
    if spec.block is not None:
        want = [math.ceil(n / spec.block[0]), math.ceil(k / spec.block[1])]
        ok = list(sshape) == want
    else:
        want = f"[{n}, 1], [{n}] or one value"
        ok = numel == 1 or (numel == n and len(sshape) <= 2 and sshape[0] == n)
    if not ok:
        _refuse(path, f"{module}.{spec.scale_name} has shape {list(sshape)}; {spec.describe()} over weight "
                      f"[{n}, {k}] needs {want}")


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q: [N, K] fp8, scale: [ceil(N/bn), ceil(K/bk)] -> [N, K] fp32 (every block times its scale; exact in fp32)."""
    n, k = q.shape
    full = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.float() * full


def load_fp8_slice(linear, slice_name: str, weight: torch.Tensor, source, key: str,
                   bias: torch.Tensor | None, shard: tuple[str, int, int] | None = None) -> None:
    """Loads checkpoint FP8 `weight` (module `key`) into slice `slice_name` of `linear`: byte for byte
    into an Fp8Linear (per channel / per tensor), requantized per channel (blocks), or dequantized
    into a plain Linear (quantization=none). shard: a tensor-parallel plain Linear's (parallel.py):
    the dequantized slice is cut to the rank's part."""
    if shard is not None:
        if isinstance(linear, Fp8Linear):
            raise ValueError(f"{key}: FP8 projections are not served under tensor parallel (quantization=none "
                             "dequantizes them)")
        from .parallel import shard_part

        def cut(t):
            return None if t is None else shard_part(t, shard)
    else:
        def cut(t):
            return t
    spec: Fp8Checkpoint | None = source.fp8
    if spec is None:
        raise ValueError(f"{key}.weight is FP8 but the checkpoint's quantization_config was not read "
                         "(load it with serve.models.load_model)")
    device = linear.weight.device  # dequantize / requantize where the weights live (the GPU when serving)
    weight, scale = weight.to(device), source.get(f"{key}.{spec.scale_name}").to(device).float()
    if spec.block is not None:
        dense = dequantize_blocks(weight, scale, spec.block)  # [N, K] fp32
        if isinstance(linear, Fp8Linear):
            q, s = quantize_weight(dense)  # the one extra rounding of block checkpoints
            linear.load_slice(slice_name, q, bias, scale=s)
        else:
            linear.load_slice(slice_name, cut(dense), cut(bias))
        return
    scale = scale.reshape(-1).expand(weight.shape[0]) if scale.numel() == 1 else scale.reshape(-1)  # [N]
    if isinstance(linear, Fp8Linear):
        linear.load_slice(slice_name, weight, bias, scale=scale)
    else:
        linear.load_slice(slice_name, cut(dequantize(weight, scale)), cut(bias))


def inspect_checkpoint(path, source, quantization: str, dtype: torch.dtype) -> Fp8Checkpoint | None:
    """Reads and checks how `source` (the weights of checkpoint `path`) stores FP8, before the model is
    built: refuses what cannot be served (ValueError, one line), sets `source.fp8`, says what load does."""
    from .loader import TEXT_PREFIXES

    spec = read_fp8_checkpoint(path)
    prefix = next((p for p in TEXT_PREFIXES if p + "embed_tokens.weight" in source), None)
    count = check_fp8_tensors(source, spec, prefix, path)
    source.fp8 = spec
    if spec is not None and count:
        if quantization != "fp8":
            log.info("%s holds %d FP8 projection weights (%s); quantization=%s: dequantized to %s at load",
                     path, count, spec.describe(), quantization, str(dtype).replace("torch.", ""))
        elif spec.block is not None:
            log.info("%s holds %d FP8 projection weights (%s): requantized per output channel at load",
                     path, count, spec.describe())
    return spec
