"""Full-size zoo models have the published architectures' shapes (built on the meta device)."""

from __future__ import annotations

import pytest
import torch

from zoo import SPECS, build_model, build_tokenizer_and_ids, get_spec

# Published shapes, written out independently of the zoo's table:
# (hidden, layers, heads, kv_heads, intermediate, vocab, vision_width, vision_depth, params in billions)
PUBLISHED = {
    "qwen2_vl_2b": (1536, 28, 12, 2, 8960, 151936, 1280, 32, 2.21),
    "qwen2_vl_7b": (3584, 28, 28, 4, 18944, 152064, 1280, 32, 8.29),
    "qwen2_vl_72b": (8192, 80, 64, 8, 29568, 152064, 1280, 32, 73.41),
    "qwen2_5_vl_3b": (2048, 36, 16, 2, 11008, 151936, 1280, 32, 3.75),
    "qwen2_5_vl_7b": (3584, 28, 28, 4, 18944, 152064, 1280, 32, 8.29),
    "llava_1_5_7b": (4096, 32, 32, 32, 11008, 32064, 1024, 24, 7.06),
    "llava_1_5_13b": (5120, 40, 40, 40, 13824, 32064, 1024, 24, 13.35),
}


def test_every_full_spec_is_checked():
    assert {n for n, s in SPECS.items() if s.size == "full"} == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_full_size_shapes_match_the_published_model(name):
    hidden, layers, heads, kv, inter, vocab, v_width, v_depth, billions = PUBLISHED[name]
    spec = get_spec(name)
    _, ids = build_tokenizer_and_ids(spec)
    model = build_model(spec, ids, seed=0, dtype="bfloat16", device="meta")
    params = dict(model.named_parameters())
    assert all(p.device.type == "meta" for p in params.values()), "no memory is allocated"
    head_dim = hidden // heads
    lm = model.model.language_model
    assert lm.embed_tokens.weight.shape == (vocab, hidden)
    assert len(lm.layers) == layers
    attn, mlp = lm.layers[0].self_attn, lm.layers[0].mlp
    assert attn.q_proj.weight.shape == (heads * head_dim, hidden)
    assert attn.k_proj.weight.shape == (kv * head_dim, hidden)
    assert attn.v_proj.weight.shape == (kv * head_dim, hidden)
    assert attn.o_proj.weight.shape == (hidden, heads * head_dim)
    assert mlp.gate_proj.weight.shape == (inter, hidden) and mlp.down_proj.weight.shape == (hidden, inter)
    assert model.lm_head.weight.shape == (vocab, hidden)
    if spec.arch == "llava":
        tower = model.model.vision_tower
        assert len(tower.encoder.layers) == v_depth
        assert tower.embeddings.patch_embedding.weight.shape[0] == v_width
        assert model.model.multi_modal_projector.linear_2.weight.shape == (hidden, hidden)
    else:
        blocks = model.model.visual.blocks
        assert len(blocks) == v_depth
        assert blocks[0].norm1.weight.shape == (v_width,)
        assert model.model.visual.merger.mlp[-1].weight.shape[0] == hidden
    total = sum(p.numel() for n, p in params.items())
    assert total == pytest.approx(billions * 1e9, rel=0.01)
    assert model.dtype == torch.bfloat16
