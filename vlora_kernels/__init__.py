"""ATMM: adaptive-tiling batched LoRA kernels (Triton), their tiling tables and the one-shot merge.

Imports only torch and triton. The public API:

    meta = build_segments(slot_ids, device)            # once per forward, shared by every layer
    add_lora(y, x, lora_a, lora_b, meta, ranks, scales, slices)   # y += LoRA(x), many adapters
    add_lora_beside(base, x, lora_a, ...)              # base(x) + LoRA(x), the shrink beside base
    shrink(...), expand(...)                           # the two halves, for callers that fuse
    fused_add_lora(..., config)                        # both in one launch (decode; add_lora picks it
                                                       # only where the table measured it faster)
    handoff_add_lora(..., config)                      # one launch, the shrink handing v to the expand
                                                       # in-launch (decode; picked as fused_add_lora is)
    merge_lora_(weight, lora_a, lora_b, slot, ...)     # W += scale * B @ A, all layers, in place
    unmerge_lora_(...)                                 # and back (also the deLoRA subtraction)
    fp8_linear(x, q_w, s_w)                            # FP8 projection: per-token x scales, rowwise GEMM
    merge_fp8_(q_w, s_w, lora_a, lora_b, slot, ...)    # FP8 W = fp8(deq(W) + scale * B @ A), fresh scales

Pool layout (one per projection kind and layer; loading an adapter is a copy into a slot):
    lora_a: [slices, slots, R, K]   lora_b: [slots, sum(slices), R]   R a multiple of 16;
    rows of A / columns of B past an adapter's rank are zero; ranks: int32 [slices, slots]
    (0 = slice not targeted); scales: float32 [slots]; slot -1 in slot_ids = no LoRA.
    Mixture: build_segments(..., mix_slot=m) adds -dW_m to every segment's tokens in the same
    launches (slot -2: a token that takes only that part).

Tilings come from `vlora_kernels/tables/<gpu>.json` (written by `vlora tune`), with a nearest-shape
and then a heuristic fallback. `reference.py` holds the fp32 reference and the PyTorch
baselines behind the same call signature.
"""

from .baselines import lora_mbgmv, lora_sgmv
from .expand import expand
from .fused import fused_add_lora
from .handoff import handoff_add_lora
from .lora import add_lora, add_lora_beside, configs_for, one_launch_for, pinned
from .fp8 import FP8_DTYPE, dequantize, fp8_linear, merge_fp8_ref_, quantize_rows, quantize_weight
from .fp8_merge import merge_fp8_
from .merge import MergeGroup, merge_groups_, merge_lora_, merge_lora_ref_, unmerge_lora_
from .reference import lora_einsum, lora_gather_bmm, lora_loop, lora_reference
from .segments import MIX_ONLY, NO_LORA, SegmentMeta, build_segments
from .shrink import shrink
from .table import TilingTable
from .tiling import ShapeKey, TileConfig, config_space, heuristic_config, shape_key

__all__ = [
    "NO_LORA", "MIX_ONLY", "SegmentMeta", "build_segments", "add_lora", "add_lora_beside", "configs_for",
    "one_launch_for", "pinned",
    "shrink", "expand", "fused_add_lora", "handoff_add_lora",
    "merge_lora_", "unmerge_lora_", "merge_lora_ref_", "merge_groups_", "MergeGroup",
    "FP8_DTYPE", "quantize_weight", "quantize_rows", "dequantize", "fp8_linear", "merge_fp8_", "merge_fp8_ref_",
    "lora_reference", "lora_loop", "lora_gather_bmm", "lora_einsum", "lora_sgmv", "lora_mbgmv",
    "TilingTable", "TileConfig", "ShapeKey", "shape_key", "config_space", "heuristic_config",
]
