"""The batched vision attention used in training computes what the transformers towers compute:
outputs and gradients, on equal and mixed picture sizes and Qwen2.5-VL's windows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from train.model import visual_features
from train.vision_attention import batch_vision_attention, grouped_attention
from zoo import load_pretrained


def test_grouped_attention_keeps_each_piece_to_itself():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(11, 2, 4, generator=g) for _ in range(3))
    lengths = [3, 5, 3]
    out = grouped_attention(q, k, v, lengths)
    at = 0
    for n in lengths:
        piece = [t[at:at + n].transpose(0, 1) for t in (q, k, v)]
        ref = torch.nn.functional.scaled_dot_product_attention(*piece).transpose(0, 1)
        torch.testing.assert_close(out[at:at + n], ref)
        at += n


def _pixels(processor, sizes):
    g = np.random.default_rng(0)
    images = [Image.fromarray(g.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    return dict(processor.image_processor(images=images, return_tensors="pt"))


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "qwen2_5_vl_tiny"])
@pytest.mark.parametrize("sizes", [[(112, 112)] * 3, [(112, 112), (84, 140), (112, 112)]])
def test_outputs_and_gradients_match_the_towers_own(name, sizes, tiny_zoo):
    results = []
    for patch in (False, True):
        model, processor = load_pretrained(tiny_zoo[name])
        if patch:
            assert batch_vision_attention(model) == model.config.vision_config.depth
        model.requires_grad_(True)
        feats = visual_features(model, _pixels(processor, sizes), grad=True)
        (feats.square().mean()).backward()
        grads = {n: p.grad.clone() for n, p in model.model.visual.named_parameters() if p.grad is not None}
        results.append((feats.detach(), grads))
    (f0, g0), (f1, g1) = results
    torch.testing.assert_close(f1, f0, atol=1e-5, rtol=1e-4)
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-4, msg=n)
