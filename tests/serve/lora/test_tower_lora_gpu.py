"""GPU: LoRA on our Qwen towers at the 7B shapes in bf16 (ATMM over the packed rows) against the
transformers tower with the same PEFT adapter. Random weights of the zoo's full-size specs."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

GRIDS = [(1, 32, 32)] * 2 + [(1, 24, 36), (3, 4, 6)]


def _peft_towers(name: str, rank: int = 16):
    """(transformers tower under a PEFT LoRA on every linear train_vision_tower adapts, ours, arch)."""
    from peft import LoraConfig, get_peft_model

    from bench.vision import towers
    from train.model import VISION_LINEARS
    from zoo.build import build_tokenizer_and_ids
    from zoo.configs import hf_config
    from zoo.specs import get_spec

    spec = get_spec(name)
    torch.manual_seed(0)
    reference, ours = towers(hf_config(spec, build_tokenizer_and_ids(spec)[1]).vision_config, spec.arch, "cuda",
                             torch.float32)
    targets = rf".*\.({'|'.join(VISION_LINEARS[spec.arch])})"
    peft = get_peft_model(reference, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets))
    with torch.no_grad():
        for param_name, param in peft.named_parameters():
            if ".lora_B." in param_name:
                param.normal_(0, 0.02)
    return peft.eval(), ours


def _pool_from_peft(peft, ours, dtype):
    """Our tower's adapter pool with the PEFT modules' A and B in slot 0 (what serve.lora.loader reads)."""
    from serve.lora import AdapterPool, AdapterWeights
    from serve.lora.tower_shapes import tower_layout

    layout = tower_layout(ours)
    pool = AdapterPool(1, layout.shapes, 1, 16, dtype, "cuda", layers=layout.layers)
    a = {k: torch.zeros(n, 1, 16, layout.shapes[k].in_features) for k, n in layout.layers.items()}
    b = {k: torch.zeros(n, layout.shapes[k].out_features, 16) for k, n in layout.layers.items()}
    ranks = {k: torch.zeros(n, 1, dtype=torch.int32) for k, n in layout.layers.items()}
    scales = {}
    for module_name, module in peft.named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        kind, layer = layout.locate("visual." + module_name.removeprefix("base_model.model."))
        a[kind][layer, 0] = module.lora_A["default"].weight.detach().flatten(1).cpu()
        b[kind][layer] = module.lora_B["default"].weight.detach().flatten(1).cpu()
        ranks[kind][layer] = 16
        scales[kind] = module.scaling["default"]
    assert set(scales) == set(layout.shapes), "every served projection is adapted"
    pool.write(0, AdapterWeights({k: v.to(dtype) for k, v in a.items()}, {k: v.to(dtype) for k, v in b.items()},
                                 ranks, scales))
    return pool


@pytest.mark.parametrize("name", ["qwen2_vl_7b", "qwen2_5_vl_7b"])
def test_full_shape_bf16_tower_lora_is_as_close_as_peft_in_bf16(name):
    from serve.lora.tower import TowerLoRA

    peft, ours = _peft_towers(name)
    width = ours.patch_embed.proj.weight[0].numel()
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), width, device="cuda")
    grid = torch.tensor(GRIDS, device="cuda")
    rows = [t * h * w for t, h, w in GRIDS]

    def reference(x):
        out = peft(x, grid_thw=grid)
        return getattr(out, "pooler_output", out).float()

    with torch.no_grad():
        truth = reference(pixels)
        with peft.disable_adapter():
            plain = reference(pixels)
        assert (truth - plain).norm() / plain.norm() > 1e-2  # the adapter acts
        peft.to(torch.bfloat16)
        ref_err = float((reference(pixels.bfloat16()) - truth).norm() / truth.norm())
        ours.to(torch.bfloat16)
        lora = TowerLoRA(None, ours, _pool_from_peft(peft, ours, torch.bfloat16), "triton")
        slots = [0, -1, 0, 0]  # the second picture without the adapter, in the same pass
        lora.bind(slots, rows)
        got = ours(pixels.bfloat16(), ours.layout(GRIDS)).float()
        lora.unbind()
    tokens = [r // 4 for r in rows]
    for i, (g, t, p) in enumerate(zip(got.split(tokens), truth.split(tokens), plain.split(tokens))):
        want = t if slots[i] == 0 else p
        err = float((g - want).norm() / want.norm())
        print(f"{name} item {i} (slot {slots[i]}): ours bf16 {err:.2e}, transformers + PEFT bf16 {ref_err:.2e}")
        assert err <= 1.5 * ref_err + 1e-3, (i, err, ref_err)
