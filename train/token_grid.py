"""Each visual token's cell centre in its picture (`heads.grid`), from the processor's own output,
so a dense detection head can be trained on what the server will give it.

Qwen2-VL / Qwen2.5-VL resize the whole picture: a merged token covers merge x merge patches of the
`image_grid_thw` / `video_grid_thw` grid. LLaVA-1.5's CLIP processor resizes the shortest side and
crops the centre, so its square patch grid covers only that window of a picture of another shape.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from heads import NOT_VISUAL, grid_xy, processor_window, square_cells


def visual_token_xy(model: Any, processor: Any, inputs: dict, mask: Tensor, sizes: list[tuple[int, int]]) -> Tensor:
    """[L, 2] for one prompt: the cell centre of each placeholder (mask True), NOT_VISUAL elsewhere.

    sizes: (width, height) of each picture (a clip: of its frames), in prompt order.
    """
    out = torch.full((mask.numel(), 2), NOT_VISUAL)
    n = int(mask.sum())
    if n == 0:
        return out
    vision = getattr(model.config, "vision_config", None)
    merge = getattr(vision, "spatial_merge_size", None)
    kinds = [k for k in ("image_grid_thw", "video_grid_thw") if inputs.get(k) is not None]
    if len(kinds) > 1:
        raise ValueError("a prompt with both pictures and clips: cell centres are laid out for one kind of media")
    grids = inputs[kinds[0]] if kinds else None
    if merge and grids is not None:
        cells = torch.cat([grid_xy(h // merge, w // merge, frames=t) for t, h, w in grids.tolist()])
    else:
        cells = _clip_cells(processor, n, sizes)
    if cells.shape[0] != n:
        raise ValueError(f"{n} visual placeholders but the picture grid has {cells.shape[0]} cells")
    out[mask] = cells
    return out


def _clip_cells(processor: Any, n: int, sizes: list[tuple[int, int]]) -> Tensor:
    """LLaVA: per picture a square grid over the processor's centre crop."""
    per = n // max(1, len(sizes))
    image_processor = getattr(processor, "image_processor", processor)
    return torch.cat([square_cells(per, processor_window(image_processor, w, h)) for w, h in sizes])
