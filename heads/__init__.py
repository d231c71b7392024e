"""Vision task heads on the language model's final hidden states.

A head replaces the LM head for answers drawn from a small set (a label, a count, boxes, yes /
no), so a request is answered by one prefill instead of token-by-token decoding (paper,
section 4.2.2). Heads are trained with a LoRA adapter and saved beside it; the same module runs
in `train/` and in `serve/`. Imports only torch, safetensors and the standard library.

    config = HeadConfig(type="classify", hidden_size=3584, labels=["walk", "run", "sit"])
    head = build_head(config)
    outputs = head(hidden, attention_mask)        # hidden: [B, T, D], mask: [B, T] (1 = real)
    loss = head.loss(outputs, head.targets_from(["run", "sit", ...]))
    results = head.decode(outputs)                # list[HeadResult], one per input
    save_head(head, "adapters/actions")           # head.safetensors + head.json
    head = load_head("adapters/actions", device="cuda", dtype=torch.bfloat16)

Heads: `ClassifyHead` (cross-entropy over labels), `CountHead` (0..max_count as classes,
larger counts clamp to the last), `DenseDetectHead` (detect's default: objectness and a box per
visual token, the token holding a box's centre owns it; owner-weighted BCE + L1 + GIoU, NMS at decode; needs
`token_xy`, the tokens' cell centres from `heads.grid`), `DetectHead` (max_boxes slots,
Hungarian-matched set loss: objectness BCE + L1 + GIoU), `BinaryHead` (one logit, BCE). Pooling of [B, T, D] to [B, D]:
"attention" (learned query, default), "last" or "mean" over real tokens. Computation is fp32
whatever the dtype of the hidden states or the stored weights.

Metrics: `accuracy`, `exact_match`, `box_iou`, `f1_at_iou` (and `detection_counts`).
"""

from .assignment import linear_sum_assignment
from .base import TaskHead
from .boxes import cxcywh_to_xyxy, generalized_iou, xyxy_to_cxcywh
from .classify import BinaryHead, ClassifyHead, CountHead
from .config import HEAD_TYPES, POOLINGS, HeadConfig, HeadResult
from .dense import DenseDetectHead
from .detect import DetectHead
from .grid import FULL, NOT_VISUAL, center_crop_window, grid_xy, processor_window, prompt_token_xy, square_cells
from .io import HEAD_CLASSES, build_head, head_paths, load_head, save_head
from .metrics import accuracy, box_iou, detection_counts, exact_match, f1_at_iou

__all__ = [
    "HeadConfig", "HeadResult", "HEAD_TYPES", "POOLINGS",
    "TaskHead", "ClassifyHead", "CountHead", "DetectHead", "DenseDetectHead", "BinaryHead", "HEAD_CLASSES",
    "grid_xy", "center_crop_window", "prompt_token_xy", "NOT_VISUAL", "FULL",
    "processor_window", "square_cells",
    "build_head", "save_head", "load_head", "head_paths",
    "accuracy", "exact_match", "box_iou", "f1_at_iou", "detection_counts",
    "linear_sum_assignment", "cxcywh_to_xyxy", "xyxy_to_cxcywh", "generalized_iou",
]
