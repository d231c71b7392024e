"""Mixed-precision training stores the frozen decoder projections in the autocast dtype once: the
forward, the loss and the LoRA gradients are the same as with float32 weights cast by autocast
on every call, and only those projections change dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from train_fixtures import tiny_domain

import train.vlm as vlm_module
from train import LoraSpec, ModelRef, VisionLM, load_domain
from train.data import collate
from train.model import AdapterModule, core_of


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """accelerate keeps one process-wide state, fixed by the first Accelerator (the other tests'
    are full precision): start this test's bf16 ones from a clean state and leave one behind."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _grads(vlm, batch):
    vlm.model.zero_grad(set_to_none=True)
    with vlm.accelerator.autocast():
        hidden = AdapterModule(vlm.model, None)(batch)["hidden"]
        loss = hidden.float().pow(2).mean()
    loss.backward()
    return hidden.detach(), {n: p.grad.clone() for n, p in vlm.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("model", ["qwen2_vl_tiny", "llava_1_5_tiny"])
def test_frozen_projections_in_bf16_change_nothing_but_their_dtype(model, tiny_zoo, vlora_home, monkeypatch):
    ref, lora = ModelRef(model, str(tiny_zoo[model])), LoraSpec(rank=4, alpha=8, dropout=0.0)
    cast = VisionLM(ref, lora, mixed_precision="bf16", device="cpu")
    monkeypatch.setattr(vlm_module, "frozen_linears_to", lambda *a: 0)
    plain = VisionLM(ref, lora, mixed_precision="bf16", device="cpu")
    plain.load_lora_state(cast.lora_state())
    with torch.no_grad():  # B = 0 at the start: give the LoRA something to say
        for a, b in zip(cast.lora_parameters(), plain.lora_parameters()):
            a.normal_(0, 0.05)
            b.copy_(a)
    layers = core_of(cast.model).language_model.layers
    frozen = [m for m in layers.modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad]
    assert frozen and all(m.weight.dtype == torch.bfloat16 for m in frozen)
    assert all(p.dtype == torch.float32 for p in cast.lora_parameters())
    others = [p for n, p in cast.model.named_parameters() if ".layers." not in n]  # embeddings, norms, towers
    assert others and all(p.dtype == torch.float32 for p in others)
    assert all(p.dtype == torch.float32 for p in plain.model.parameters())

    data = load_domain(tiny_domain(vlora_home, "color_largest", tiny_zoo[model], limit=12))
    rows = data.rows("train", range(3))
    h_cast, g_cast = _grads(cast, collate(cast.encoder.encode_many(rows, data.info), cast.encoder.pad_id))
    h_plain, g_plain = _grads(plain, collate(plain.encoder.encode_many(rows, data.info), plain.encoder.pad_id))
    assert torch.equal(h_cast, h_plain)
    assert g_cast.keys() == g_plain.keys() and all(torch.equal(g_cast[k], g_plain[k]) for k in g_cast)
    assert any(g.abs().sum() > 0 for g in g_cast.values())
