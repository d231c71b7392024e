"""FP8 projections of the language model (`EngineConfig.quantization="fp8"`).

Every projection `Linear` (qkv / o / gate_up / down, serve/models/layers.py) is replaced once, after
the bf16 checkpoint is loaded, by an `Fp8Linear` holding the weight as float8_e4m3fn with one fp32
scale per output channel; each forward quantizes the activation per token and runs one rowwise
scaled FP8 GEMM (vlora_kernels/fp8.py), bf16 out. With the Triton backend the norm before qkv and gate_up,
the SiLU-mul before down and, at decode, the attention before o_proj write that quantization themselves
(`fuse_quantization`); o_proj quantizes its own input only in prefill. Embedding, norms, LM head and the vision tower stay in
the checkpoint's dtype. LoRA wraps an `Fp8Linear` exactly as it wraps a `Linear`: the adapter
branch reads the bf16 activation and adds in bf16 (serve/lora/layers.py).

Serving FP8 needs FP8 tensor cores (compute capability 8.9: Ada, Hopper and newer); `check_quantization`
refuses anything else before the model is loaded. The CPU runs the same math (torch._scaled_mm has
a CPU implementation), slowly: `ALLOW_CPU` lets tests run the engine with it.
"""

from __future__ import annotations

import torch
from torch import nn

from vlora_kernels.fp8 import FP8_DTYPE, dequantize, fp8_linear, quantize_weight
from vlora_kernels.fp8_decode import group_scales_fit

from .layers import Linear

QUANTIZATIONS = ("none", "fp8")
MIN_CAPABILITY = (8, 9)
ALLOW_CPU = False  # tests only: let an engine on the CPU run FP8 projections (slow, never for serving)
# the fused norms and SiLU-mul (Triton backend) write their output's FP8 rows for the projection after
# them (vlora_kernels/fp8_fused.py); off: every projection quantizes its input itself (the A/B of bench.fp8)
FUSE_QUANTIZATION = True
# with it, the decode attention writes o_proj's FP8 rows, one scale per (token, kv head group)
# (serve/forward/decode_kernel.py); off: o_proj quantizes its input per token itself (bench.fp8's A/B)
FUSE_ATTENTION_ROWS = True


def check_quantization(quantization: str, device: torch.device) -> None:
    """Raises ValueError (one line) when `quantization` cannot be served on `device`."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not one of {QUANTIZATIONS}")
    if quantization == "none":
        return
    if device.type == "cpu":
        if not ALLOW_CPU:
            raise ValueError("quantization=fp8 needs a GPU with FP8 tensor cores (compute capability >= 8.9); "
                             "this engine runs on the CPU: use quantization=none")
        return
    if device.type != "cuda":
        raise ValueError(f"quantization=fp8 needs a CUDA GPU, the engine runs on {device}")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(f"quantization=fp8 needs compute capability >= 8.9 (Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: "
                         "use quantization=none")


class Fp8Linear(nn.Module):
    """A projection with FP8 weights; x: [T, in] (bf16) -> y: [T, sum(output_slices)] in x's dtype.

    weight: [N, K] float8_e4m3fn, weight_scale: [N] fp32 (W ~= weight * weight_scale[:, None]);
    the bias, if any, stays in the checkpoint's dtype. Same description as `Linear`
    (in_features, output_slices, slice_names, slice_range), so adapters and the merger see one shape.
    """

    def __init__(self, linear: Linear, quantize: bool = True):
        """quantize=False: empty FP8 weights for `load_slice` to fill (a checkpoint that holds FP8)."""
        super().__init__()
        self.in_features = linear.in_features
        self.output_slices = linear.output_slices
        self.slice_names = linear.slice_names
        self.layer_index = linear.layer_index
        self.out_dtype = linear.weight.dtype
        if quantize:
            q, scale = quantize_weight(linear.weight.data)
        else:
            device = linear.weight.device
            q = torch.zeros(linear.out_features, linear.in_features, dtype=FP8_DTYPE, device=device)
            scale = torch.ones(linear.out_features, dtype=torch.float32, device=device)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = linear.bias

    out_features = Linear.out_features
    slice_range = Linear.slice_range

    def load_slice(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   scale: torch.Tensor | None = None) -> None:
        """Rows of slice `name` from a checkpoint: FP8 `weight` [n, K] with its `scale` [n] copied as
        they are, or a float weight quantized per row here, as `quantize_projections` would (each row
        has its own scale, so a slice quantizes alone exactly as inside the fused weight)."""
        start, end = self.slice_range(name)
        if tuple(weight.shape) != (end - start, self.in_features):
            raise ValueError(f"{name}: checkpoint weight {tuple(weight.shape)} does not fit "
                             f"[{end - start}, {self.in_features}]")
        if weight.dtype != FP8_DTYPE:
            weight, scale = quantize_weight(weight.to(self.weight.device, self.out_dtype))
        elif scale is None or tuple(scale.shape) != (end - start,):
            raise ValueError(f"{name}: an FP8 weight needs one scale per row, [{end - start}], got "
                             f"{None if scale is None else tuple(scale.shape)}")
        self.weight.data[start:end].copy_(weight)
        self.weight_scale.data[start:end].copy_(scale)
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"{name}: the checkpoint has a bias but the layer was built without one")
            self.bias.data[start:end].copy_(bias)

    def dequantized(self) -> torch.Tensor:
        """The weight the GEMM multiplies by, [N, K] fp32."""
        return dequantize(self.weight, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, slices={dict(zip(self.slice_names, self.output_slices))}, fp8"


def quantize_projections(language_model) -> int:
    """Replaces every projection `Linear` of a DecoderModel by an `Fp8Linear`, layer by layer, so
    the bf16 weights are freed as it goes (peak: one projection in both forms). Returns the count."""
    count = 0
    for layer, kind, module in list(language_model.projections()):
        if isinstance(module, Fp8Linear):
            continue
        if not isinstance(module, Linear):
            raise TypeError(f"layer {layer} {kind}: FP8 quantizes plain projections, found {type(module).__name__} "
                            "(quantize before adapters wrap them)")
        language_model.set_projection(layer, kind, Fp8Linear(module))
        count += 1
    if FUSE_QUANTIZATION:
        fuse_quantization(language_model)
    return count


def quantize_lm_head(language_model) -> None:
    """The LM head's weight (the embedding table when tied) quantized per vocabulary row, once: compute_logits then
    runs fp8_linear on it, the decode step's logits reading half the bytes (1.09 GB -> 0.55 GB at the 7B's
    152,064 x 3,584). The bf16 weight stays: a tied head is the embedding table too."""
    q, scale = quantize_weight(language_model.head_weight().data)
    language_model.lm_head_fp8, language_model.lm_head_scale = q, scale


def prepare_fp8_projections(language_model) -> int:
    """Replaces every projection `Linear` by an empty `Fp8Linear` before a checkpoint that holds FP8
    weights loads into it (fp8_checkpoint.py): its bytes and scales go in as they are stored."""
    count = 0
    for layer, kind, module in list(language_model.projections()):
        if isinstance(module, Linear):
            language_model.set_projection(layer, kind, Fp8Linear(module, quantize=False))
            count += 1
    return count


def fuse_quantization(language_model, on: bool = True) -> int:
    """Lets the kernel before each FP8 projection write its FP8 input: input_layernorm for qkv_proj,
    post_attention_layernorm for gate_up_proj, the SiLU-mul for down_proj, and at decode the attention for
    o_proj (FUSE_ATTENTION_ROWS; its rows have one scale per kv head group, which the decode GEMM takes where
    a group is whole K tiles: `group_scales_fit`). Only where that kernel is the fused Triton one; the PyTorch
    path is unchanged. Returns the producers switched."""
    count = 0
    for layer in language_model.layers:
        for producer, attr, projection in ((layer.input_layernorm, "fp8_output", layer.attn.qkv_proj),
                                           (layer.post_attention_layernorm, "fp8_output", layer.mlp.gate_up_proj),
                                           (layer.mlp, "fp8_act", layer.mlp.down_proj)):
            fused = producer.fused and on and is_fp8(getattr(projection, "base", projection))
            setattr(producer, attr, fused)
            count += fused
        attention, o_proj = layer.attn.attn, getattr(layer.attn.o_proj, "base", layer.attn.o_proj)
        fused = (on and FUSE_ATTENTION_ROWS and attention.backend == "triton" and is_fp8(o_proj)
                 and group_scales_fit(o_proj.out_features, o_proj.in_features, attention.num_kv_heads))
        attention.fp8_output = fused
        count += fused
    return count


def is_fp8(module: nn.Module) -> bool:
    return getattr(module, "weight", None) is not None and module.weight.dtype == FP8_DTYPE
