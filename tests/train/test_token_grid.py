"""Visual tokens' cell centres against the processors' own pixels: a token whose cell centre lies in
a red square of the picture must be a token whose pixels are red, for Qwen's resized grid (a photo of
odd size) and LLaVA's centre crop (a wide photo); and the centres survive encoding and batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoProcessor

from heads import NOT_VISUAL
from train.data import Encoded, batch_token_xy, collate
from train.token_grid import visual_token_xy

RED = (0.3, 0.2, 0.55, 0.6)  # the red square, normalised (x1, y1, x2, y2)


def picture(width: int, height: int) -> Image.Image:
    a = np.full((height, width, 3), 40, np.uint8)
    x1, y1, x2, y2 = RED
    a[int(y1 * height):int(y2 * height), int(x1 * width):int(x2 * width)] = (230, 20, 20)
    return Image.fromarray(a)


def inside(xy: torch.Tensor, margin: float) -> torch.Tensor:
    x1, y1, x2, y2 = RED
    return ((xy[:, 0] > x1 + margin) & (xy[:, 0] < x2 - margin) & (xy[:, 1] > y1 + margin) & (xy[:, 1] < y2 - margin))


def outside(xy: torch.Tensor, margin: float) -> torch.Tensor:
    x1, y1, x2, y2 = RED
    return ((xy[:, 0] < x1 - margin) | (xy[:, 0] > x2 + margin) | (xy[:, 1] < y1 - margin) | (xy[:, 1] > y2 + margin))


def encode(path, image):
    processor = AutoProcessor.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    model = type("M", (), {"config": config})()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "cars?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    ids = inputs["input_ids"][0]
    token = getattr(config, "image_token_id", getattr(config, "image_token_index", None))
    mask = ids == token
    return inputs, mask, visual_token_xy(model, processor, inputs, mask, [image.size]), config


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "qwen2_5_vl_tiny"])
def test_qwen_cells_match_the_processors_patches(tiny_zoo, name):
    image = picture(333, 201)  # odd size: the processor resizes to a multiple of 28 of another aspect
    inputs, mask, xy, config = encode(tiny_zoo[name], image)
    assert (xy[~mask] == NOT_VISUAL).all() and ((xy[mask] > 0) & (xy[mask] < 1)).all()
    m = config.vision_config.spatial_merge_size
    t, h, w = inputs["image_grid_thw"][0].tolist()
    assert int(mask.sum()) == t * h * w // (m * m)
    # each merged token's m*m patches are consecutive rows of pixel_values: their mean colour
    patches = inputs["pixel_values"].view(int(mask.sum()), m * m, 3, -1)  # [tokens, m*m, C, T*P*P]
    red = (patches[:, :, 0].mean((1, 2)) - patches[:, :, 1].mean((1, 2))) > 1.0  # normalised red minus green
    cells = xy[mask]
    assert red[inside(cells, 0.04)].all() and inside(cells, 0.04).sum() >= 2
    assert not red[outside(cells, 0.06)].any()


def test_llava_cells_map_the_centre_crop_back_to_the_picture(tiny_zoo):
    image = picture(640, 320)  # wide: the crop keeps the middle half of the width
    inputs, mask, xy, config = encode(tiny_zoo["llava_1_5_tiny"], image)
    cells = xy[mask]
    side = int(round((cells[:, 0] >= 0).sum().item() ** 0.5))
    assert cells[:, 0].min() > 0.24 and cells[:, 0].max() < 0.76  # only the centre square is seen
    pixels = inputs["pixel_values"][0]  # [3, S, S]
    patch = pixels.shape[-1] // side
    grid = pixels.unfold(1, patch, patch).unfold(2, patch, patch).mean((-1, -2))  # [3, side, side]
    red = ((grid[0] - grid[1]) > 1.0).flatten()
    seen = cells[cells[:, 0] >= 0]
    assert red[inside(seen, 0.03)].all() and inside(seen, 0.03).sum() >= 2
    assert not red[outside(seen, 0.05)].any()


def test_token_xy_is_extended_and_padded_with_not_visual():
    a = Encoded(torch.tensor([1, 2, 3]), torch.arange(3), torch.tensor([False, True, True]), None,
                token_xy=torch.tensor([[-1.0, -1.0], [0.25, 0.5], [0.75, 0.5]]))
    b = Encoded(torch.tensor([4]), torch.arange(1), torch.tensor([False]), None, token_xy=torch.full((1, 2), -1.0))
    grown = a.extend(torch.tensor([7, 8]))
    assert grown.token_xy.shape == (5, 2) and (grown.token_xy[3:] == NOT_VISUAL).all()
    xy = batch_token_xy([a, b])
    assert xy.shape == (2, 3, 2) and torch.equal(xy[0], a.token_xy) and (xy[1] == NOT_VISUAL).all()
    batch = collate([a, b], pad_id=0, answers=[torch.tensor([9]), torch.tensor([9, 9])])
    assert batch["token_xy"].shape == (2, 4, 2) and (batch["token_xy"][0, 3] == NOT_VISUAL).all()
    assert batch_token_xy([a, Encoded(torch.tensor([4]), torch.arange(1), torch.tensor([False]), None)]) is None
