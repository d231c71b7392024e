"""The ATMM op reproduces a PEFT LoRA layer holding the same A, B and scaling."""

from __future__ import annotations

import torch
from lora_cases import DEVICE, rel_err
from peft import LoraConfig, get_peft_model

from vlora_kernels.lora import add_lora
from vlora_kernels.segments import build_segments


def test_matches_a_peft_lora_linear():
    torch.manual_seed(0)
    k, n, r, alpha, slots, slot = 48, 40, 8, 16, 3, 1
    base = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(torch.bfloat16).to(DEVICE)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=["0"], lora_dropout=0.0))
    layer = model.base_model.model[0]
    torch.nn.init.normal_(layer.lora_B["default"].weight)  # PEFT starts B at zero: a vacuous check
    x = torch.randn(6, k, dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        expected = model(x)
    lora_a = torch.zeros(1, slots, 16, k, dtype=torch.bfloat16, device=DEVICE)  # pool with max rank 16
    lora_b = torch.zeros(slots, n, 16, dtype=torch.bfloat16, device=DEVICE)
    lora_a[0, slot, :r] = layer.lora_A["default"].weight.detach()
    lora_b[slot, :, :r] = layer.lora_B["default"].weight.detach()
    ranks = torch.tensor([[0, r, 0]], dtype=torch.int32, device=DEVICE)
    scales = torch.tensor([0.0, layer.scaling["default"], 0.0], dtype=torch.float32, device=DEVICE)
    with torch.no_grad():
        base_only = x @ layer.base_layer.weight.T
    out = add_lora(base_only.clone(), x, lora_a, lora_b, build_segments([slot] * 6, DEVICE), ranks, scales, (n,))
    assert layer.scaling["default"] == alpha / r
    assert rel_err(out, expected) < 2e-2
    assert rel_err(base_only, expected) > 0.1, "the adapter's contribution is large enough to be checked"
