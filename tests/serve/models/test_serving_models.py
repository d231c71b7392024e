"""Serving models: M-RoPE positions against transformers' get_rope_index, weight layouts, the
projection hook points, and prompt processing."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from serve_cases import frames, hf_inputs, hf_model, image

from serve.forward.context import StepContext, step_context
from serve.models import PROJECTIONS, VisionGrid, load_model, mrope_prompt_positions
from serve.models.loader import WeightSource


def _prefill_logits(model, prompt):
    """Logits of every prompt position from a cache-less forward (dense attention)."""
    n = len(prompt.token_ids)
    positions, delta = model.prompt_positions(prompt.token_ids, prompt.vision)
    mask = torch.zeros(n, dtype=torch.bool)
    for v in prompt.vision:
        mask[v.offset:v.offset + v.num_tokens] = True
    embeds = model.encode(prompt.vision)
    ctx = StepContext(None, None, None, None, n, n, False, query_lens_list=[n], context_lens_list=[n])
    with torch.no_grad(), step_context(ctx):
        hidden = model(torch.tensor(prompt.token_ids), model.positions(positions, delta, n, 0, n),
                       torch.cat(embeds) if embeds else None, mask)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "qwen2_5_vl_tiny"])
def test_mrope_positions_equal_get_rope_index(name, tiny_zoo):
    hf, processor = hf_model(str(tiny_zoo[name]))
    ids = processor.tokenizer
    image_id, video_id = hf.config.image_token_id, hf.config.video_token_id
    # text, image 8x10, text, video 3x4x6 (t=3), image 4x4, text; second_per_grid_t 1.5 spaces video frames
    layout = [(None, 5), ("image", (1, 8, 10)), (None, 3), ("video", (3, 4, 6)), ("image", (1, 4, 4)), (None, 4)]
    tokens, grids = [], []
    for kind, what in layout:
        if kind is None:
            tokens += ids("hello there friend", add_special_tokens=False)["input_ids"][:1] * what
        else:
            t, h, w = what
            tokens += [image_id if kind == "image" else video_id] * (t * h * w // 4)
            grids.append(VisionGrid(kind, what, 1.5 if kind == "video" else 1.0))
    input_ids = torch.tensor([tokens])
    types = (input_ids == image_id).long() + 2 * (input_ids == video_id).long()
    kwargs = dict(image_grid_thw=torch.tensor([g.thw for g in grids if g.kind == "image"]),
                  video_grid_thw=torch.tensor([g.thw for g in grids if g.kind == "video"]), mm_token_type_ids=types)
    if name == "qwen2_5_vl_tiny":
        kwargs["second_per_grid_ts"] = torch.tensor([1.5])
    want, want_delta = hf.model.get_rope_index(input_ids, **kwargs)
    tps = getattr(hf.config.vision_config, "tokens_per_second", None) if name == "qwen2_5_vl_tiny" else None
    got, delta = mrope_prompt_positions(tokens, grids, image_id, video_id, 2, tps)
    assert torch.equal(got, want[:, 0]) and delta == int(want_delta)
    with pytest.raises(ValueError, match="placeholders but its grid"):
        mrope_prompt_positions(tokens, [VisionGrid("image", (1, 4, 4))] + grids[1:], image_id, video_id, 2, tps)


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "llava_1_5_tiny"])
def test_prefill_logits_equal_transformers_from_any_weight_layout(name, tiny_zoo):
    hf, processor = hf_model(str(tiny_zoo[name]))
    spec = dict(prompt="How many cars?", images=[image(0)])
    with torch.no_grad():
        want = hf(**hf_inputs(processor, spec)).logits[0]
    # the zoo's on-disk layout, and transformers' in-memory names (model.language_model.*, model.visual.*)
    for weights in (None, {k: v.clone() for k, v in hf.state_dict().items()}):
        model, proc = load_model(tiny_zoo[name], weights=weights)
        got = _prefill_logits(model, proc.process(spec["prompt"], images=spec["images"]))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_missing_tensor_is_named(tiny_zoo):
    source = WeightSource.from_dir(tiny_zoo["qwen2_vl_tiny"])
    tensors = {n: source.get(n) for n in source.names() if n != "model.layers.2.mlp.up_proj.weight"}
    with pytest.raises(KeyError, match="model.layers.2.mlp.up_proj.weight"):
        load_model(tiny_zoo["qwen2_vl_tiny"], weights=tensors)
    tensors = {n: source.get(n) for n in source.names() if not n.startswith("visual.blocks.1.")}
    with pytest.raises(KeyError, match="vision tower"):
        load_model(tiny_zoo["qwen2_vl_tiny"], weights=tensors)


def test_projection_hooks_expose_sliced_layers_and_can_be_replaced(tiny_zoo):
    path = tiny_zoo["qwen2_vl_tiny"]
    model, proc = load_model(path)
    lm = model.language_model
    found = list(lm.projections())
    assert len(found) == 4 * model.args.num_layers and {n for _, n, _ in found} == set(PROJECTIONS)
    qkv = lm.layers[1].attn.qkv_proj
    assert qkv.slice_names == ("q_proj", "k_proj", "v_proj") and qkv.output_slices == (128, 64, 64)
    source = WeightSource.from_dir(path)
    start, end = qkv.slice_range("k_proj")
    assert torch.equal(qkv.weight[start:end], source.get("model.layers.1.self_attn.k_proj.weight"))
    gate_up = lm.layers[0].mlp.gate_up_proj
    assert torch.equal(gate_up.weight[slice(*gate_up.slice_range("up_proj"))],
                       source.get("model.layers.0.mlp.up_proj.weight"))

    prompt = proc.process("How many cars?", images=[image(0)])
    base = _prefill_logits(model, prompt)
    calls = []

    class Wrapped(torch.nn.Module):  # what an adapter layer does: base output plus a delta
        def __init__(self, inner, delta):
            super().__init__()
            self.inner, self.delta = inner, delta

        def forward(self, x):
            calls.append(x.shape[0])
            return self.inner(x) + self.delta

    for i, name, module in found:
        if name == "down_proj":
            lm.set_projection(i, name, Wrapped(module, 0.0))
    assert torch.equal(_prefill_logits(model, prompt), base) and len(calls) == model.args.num_layers
    lm.set_projection(0, "o_proj", Wrapped(lm.layers[0].attn.o_proj, 0.5))
    assert not torch.allclose(_prefill_logits(model, prompt), base)
    with pytest.raises(KeyError, match="unknown projection"):
        lm.set_projection(0, "q_proj", Wrapped(qkv, 0.0))


def test_prompt_processing_inputs_and_errors(tiny_zoo):
    _, qwen = load_model(tiny_zoo["qwen2_vl_tiny"])
    _, llava = load_model(tiny_zoo["llava_1_5_tiny"])
    array = image(4)
    png = io.BytesIO()
    Image.fromarray(array).save(png, format="PNG")
    from_array = qwen.process("Cars?", images=[array])
    from_bytes = qwen.process("Cars?", images=[png.getvalue()])
    assert from_array.token_ids == from_bytes.token_ids
    assert from_array.vision[0].content_hash == from_bytes.vision[0].content_hash
    assert qwen.process("Cars?", images=[image(5)]).vision[0].content_hash != from_array.vision[0].content_hash
    clip = qwen.process("Which way?", video=frames(1))
    assert [v.kind for v in clip.vision] == ["video"] and clip.vision[0].grid_thw == (2, 4, 4)
    with pytest.raises(ValueError, match="one placeholder per image"):
        qwen.process("no placeholder here", images=[array], raw_prompt=True)
    with pytest.raises(ValueError, match="takes no video"):
        llava.process("Which way?", video=frames(1))
    with pytest.raises(ValueError, match=r"uint8 \[H, W, 3\]"):
        qwen.process("Cars?", images=[array.astype("float32")])
    with pytest.raises(ValueError, match="needs `prompt`"):
        qwen.process()
