"""The small zoo model of the demo's GPU profile: a real checkpoint directory of tens of millions
of parameters, whose processor scales the world's frames up to 256 visual tokens."""

from __future__ import annotations

import numpy as np
from PIL import Image

from zoo import build_checkpoint, get_spec, load_pretrained


def test_small_model_builds_loads_and_sees_a_frame_as_256_tokens(tmp_path):
    path = build_checkpoint("qwen2_vl_small", tmp_path / "qwen2_vl_small")
    model, processor = load_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    assert 20e6 < params < 300e6, params  # tens of millions: pretrained on a GPU in minutes
    assert next(model.parameters()).dtype.is_floating_point and get_spec("qwen2_vl_small").size == "small"
    assert str(next(model.parameters()).dtype) == "torch.float32"  # trained from scratch: full precision
    frame = Image.fromarray(np.random.default_rng(0).integers(0, 255, (224, 224, 3), dtype=np.uint8))
    inputs = processor(text=["<|vision_start|><|image_pad|><|vision_end|>How many cars?"], images=[frame],
                       return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 32, 32]]  # 448 x 448 in patches of 14
    out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 2
