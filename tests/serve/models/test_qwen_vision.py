"""Our Qwen vision towers and segment attention against transformers' towers (fp32, tiny zoo)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from serve_cases import hf_model

from serve.forward.segments import plan_segments, segment_attention
from serve.models.qwen_layout import qwen_layout
from serve.models.qwen_vision import QwenVisionTower

# images of odd grids (partial Qwen2.5-VL windows on the right and bottom edges), a 3-group clip,
# a one-frame-group clip and a grid smaller than one window
GRIDS = [(1, 8, 10), (3, 4, 6), (1, 6, 6), (1, 2, 2), (2, 10, 4)]


def _reference_attention(q, k, v, lengths):
    out, at = [], 0
    for n in lengths:
        s = slice(at, at + n)
        out.append(torch.softmax(q[s].transpose(0, 1) @ k[s].transpose(0, 1).transpose(1, 2) / q.shape[-1] ** 0.5,
                                 -1) @ v[s].transpose(0, 1))
        at += n
    return torch.cat(out, dim=1).transpose(0, 1)


@pytest.mark.parametrize("lengths", [[16, 16, 16], [5, 16, 5, 9, 1], [7]])
def test_segment_attention_matches_a_per_segment_loop(lengths):
    g = torch.Generator().manual_seed(len(lengths))
    q, k, v = (torch.randn(sum(lengths), 3, 8, generator=g) for _ in range(3))
    got = segment_attention(q, k, v, plan_segments(lengths, "cpu"))
    torch.testing.assert_close(got, _reference_attention(q, k, v, lengths), atol=1e-5, rtol=1e-5)


def test_segment_attention_refuses_bad_plans():
    q = torch.zeros(10, 2, 4)
    with pytest.raises(ValueError, match="positive"):
        plan_segments([4, 0, 6], "cpu")
    with pytest.raises(ValueError, match="10 rows against segments covering 9"):
        segment_attention(q, q, q, plan_segments([4, 5], "cpu"))
    with pytest.raises(ValueError, match="varlen attention needs CUDA"):
        segment_attention(q, q, q, plan_segments([4, 6], "cpu"), mode="varlen")
    with pytest.raises(ValueError, match="mode must be one of"):
        segment_attention(q, q, q, plan_segments([4, 6], "cpu"), mode="flash")


def test_layout_refuses_a_grid_that_does_not_merge():
    with pytest.raises(ValueError, match="merge blocks"):
        qwen_layout([(1, 5, 4)], 2, "cpu")


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "qwen2_5_vl_tiny"])
def test_tower_equals_transformers(name, tiny_zoo):
    hf, _ = hf_model(str(tiny_zoo[name]))
    reference = hf.model.visual
    vc = hf.config.vision_config
    tower = QwenVisionTower(vc, "qwen2_vl" if name == "qwen2_vl_tiny" else "qwen2_5_vl")
    tower.load_state_dict(reference.state_dict())
    width = reference.patch_embed.proj.weight[0].numel()
    rng = np.random.default_rng(0)
    pixels = torch.tensor(rng.standard_normal((sum(t * h * w for t, h, w in GRIDS), width)), dtype=torch.float32)
    with torch.no_grad():
        want = reference(pixels, grid_thw=torch.tensor(GRIDS))
        want = getattr(want, "pooler_output", want)
        got = tower(pixels, tower.layout(GRIDS))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # items alone give the same rows as in the packed step (no leakage across segments)
    rows = [t * h * w for t, h, w in GRIDS]
    with torch.no_grad():
        for grid, item, out in zip(GRIDS, pixels.split(rows), got.split([n // 4 for n in rows])):
            torch.testing.assert_close(tower(item, tower.layout([grid])), out, atol=1e-5, rtol=1e-5)


def test_windows_cover_partial_edges(tiny_zoo):
    hf, _ = hf_model(str(tiny_zoo["qwen2_5_vl_tiny"]))
    tower = QwenVisionTower(hf.config.vision_config, "qwen2_5_vl")
    layout = tower.layout([(1, 8, 10)])  # 4 x 5 merge units, windows of 2 x 2: the last column is partial
    assert tower.window == 2
    assert sorted({length for length, _, _ in layout.windows.groups}) == [8, 16]
    assert layout.order.shape[0] == 80 and sorted(layout.order.tolist()) == list(range(80))


@pytest.mark.parametrize("layers", [-2, [-3, -1], 0])
def test_clip_tower_equals_transformers_and_stops_at_the_feature_layer(tiny_zoo, layers):
    from serve.models.clip_vision import ClipVisionTower

    hf, _ = hf_model(str(tiny_zoo["llava_1_5_tiny"]))
    reference = hf.model.vision_tower
    vc = hf.config.vision_config
    wanted = [layers] if isinstance(layers, int) else layers
    tower = ClipVisionTower(vc, wanted)
    state = {k.replace("vision_model.", ""): v for k, v in reference.state_dict().items()}
    missing = tower.load_state_dict(state, strict=False)
    assert not missing.missing_keys
    depth = vc.num_hidden_layers
    assert len(tower.encoder.layers) == max(i if i >= 0 else depth + 1 + i for i in wanted)
    pixels = torch.randn(3, 3, vc.image_size, vc.image_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = reference(pixels, output_hidden_states=True).hidden_states
        got = tower(pixels)
    for g, i in zip(got, wanted):
        torch.testing.assert_close(g, hidden[i], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="outside"):
        ClipVisionTower(vc, [depth + 1])
