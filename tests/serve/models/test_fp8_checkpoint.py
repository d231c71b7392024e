"""Checkpoints that already hold FP8 projections (serve/models/fp8_checkpoint.py), on the CPU: each
served layout loads byte for byte (fused q|k|v and gate|up stack their parts' scales), blocks are
requantized per channel within half an e4m3 step, quantization=none dequantizes, and what cannot be
served is refused before the model is built, with its reason."""

from __future__ import annotations

import logging

import pytest
import torch
from fp8_checkpoints import BLOCK, quantization_config, stored_tensors, write_config, write_fp8_checkpoint

from vlora_kernels.fp8 import FP8_DTYPE, dequantize, quantize_weight
from serve.models import load_model
from serve.models.fp8 import Fp8Linear
from serve.models.fp8_checkpoint import dequantize_blocks

PARTS = {"qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "o_proj": ["self_attn.o_proj"],
         "gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"], "down_proj": ["mlp.down_proj"]}


@pytest.fixture(scope="module")
def ckpts(tiny_zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_ckpts")
    src = tiny_zoo["qwen2_vl_tiny"]
    return {layout: write_fp8_checkpoint(src, root / layout, layout)
            for layout in ("fbgemm_fp8", "ct_channel", "ct_tensor", "fp8_block", "ct_block")}


def _stored(tensors: dict, layer: int, kind: str, scale_name: str = "weight_scale"):
    """The checkpoint's parts of one fused projection stacked along N: (fp8 [N, K], scale as stored)."""
    keys = [f"model.layers.{layer}.{part}" for part in PARTS[kind]]
    return (torch.cat([tensors[k + ".weight"] for k in keys]),
            [tensors[f"{k}.{scale_name}"] for k in keys])


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("layout", ["fbgemm_fp8", "ct_channel"])
def test_per_channel_checkpoints_load_byte_for_byte_as_our_own_quantization(ckpts, tiny_zoo, layout):
    model, _ = load_model(ckpts[layout], dtype="bfloat16", quantization="fp8")
    ours, _ = load_model(tiny_zoo["qwen2_vl_tiny"], dtype="bfloat16", quantization="fp8")
    tensors = stored_tensors(ckpts[layout])
    for (layer, kind, got), (_, _, ref) in zip(model.language_model.projections(),
                                              ours.language_model.projections()):
        assert isinstance(got, Fp8Linear) and got.weight.dtype == FP8_DTYPE
        q, scales = _stored(tensors, layer, kind)
        assert _same_bytes(got.weight, q)
        assert torch.equal(got.weight_scale, torch.cat([s.reshape(-1) for s in scales]))  # [N, 1] each -> [N]
        # the bytes the engine computes from the bf16 checkpoint: same bytes, same GEMMs from here on
        assert _same_bytes(got.weight, ref.weight) and torch.equal(got.weight_scale, ref.weight_scale)
        if got.bias is not None:
            assert torch.equal(got.bias, ref.bias)


def test_bf16_channel_scales_and_a_per_tensor_scale_load_exactly(ckpts, tiny_zoo, tmp_path):
    """llm-compressor stores scales in the model's dtype; a per-tensor scale covers all of its rows."""
    bf16 = write_fp8_checkpoint(tiny_zoo["qwen2_vl_tiny"], tmp_path / "bf16_scales", "ct_channel",
                                scale_dtype=torch.bfloat16)
    for path in (bf16, ckpts["ct_tensor"]):
        model, _ = load_model(path, dtype="bfloat16", quantization="fp8")
        tensors = stored_tensors(path)
        for layer, kind, got in model.language_model.projections():
            q, scales = _stored(tensors, layer, kind)
            rows = [n for n in got.output_slices]
            assert _same_bytes(got.weight, q)
            want = torch.cat([s.float().reshape(-1).expand(n) for s, n in zip(scales, rows)])
            assert torch.equal(got.weight_scale, want)


@pytest.mark.parametrize("layout, scale_name", [("fp8_block", "weight_scale_inv"), ("ct_block", "weight_scale")])
def test_block_scales_are_requantized_per_channel_within_half_an_e4m3_step(ckpts, layout, scale_name):
    model, _ = load_model(ckpts[layout], dtype="bfloat16", quantization="fp8")
    tensors = stored_tensors(ckpts[layout])
    worst = 0.0
    for layer, kind, got in model.language_model.projections():
        q, scales = _stored(tensors, layer, kind, scale_name)
        parts = torch.split(q, list(got.output_slices))
        dense = torch.cat([dequantize_blocks(p, s, BLOCK) for p, s in zip(parts, scales)])  # exact in fp32
        ref_q, ref_s = quantize_weight(dense)
        assert _same_bytes(got.weight, ref_q) and torch.equal(got.weight_scale, ref_s)
        err = (got.dequantized() - dense).abs()
        # half an e4m3 step: 2**-4 of the value, or 2**-10 of the row's scale among the subnormals
        bound = torch.maximum(dense.abs() * 2.0 ** -4, got.weight_scale[:, None] * 2.0 ** -10)
        assert bool((err <= bound * 1.0001).all())
        worst = max(worst, float((err / dense.abs().amax(-1, keepdim=True)).max()))
    # half the top binade's step (16 of 448): the bound docs/engine.md states; reached here (0.0357)
    assert 0 < worst <= 16 / 448 * 1.0001


def test_without_quantization_the_fp8_weights_are_dequantized_to_the_engine_dtype(ckpts, caplog):
    with caplog.at_level(logging.INFO, logger="serve.models.fp8_checkpoint"):
        model, _ = load_model(ckpts["fbgemm_fp8"], dtype="bfloat16")
    assert "holds 28 FP8 projection weights (fbgemm_fp8 (per channel)); quantization=none: dequantized to " \
           "bfloat16 at load" in caplog.text
    tensors = stored_tensors(ckpts["fbgemm_fp8"])
    for layer, kind, got in model.language_model.projections():
        q, scales = _stored(tensors, layer, kind)
        assert got.weight.dtype == torch.bfloat16
        assert torch.equal(got.weight, dequantize(q, torch.cat([s.reshape(-1) for s in scales])).bfloat16())


def _variant(base, tmp_path, qc: dict | None):
    """`base` with another quantization_config (the tensors are links to base's)."""
    out = tmp_path / "variant"
    out.mkdir()
    for f in base.iterdir():
        (out / f.name).symlink_to(f)
    (out / "config.json").unlink()
    (out / "config.json").write_text((base / "config.json").read_text())
    write_config(out, qc)
    return out


def _ct(**weights_and_acts) -> dict:
    qc = quantization_config("ct_channel")
    group = qc["config_groups"]["group_0"]
    for key, value in weights_and_acts.items():
        where, field = key.split("__")
        group[where][field] = value
    return qc


REFUSED_CONFIGS = [
    ({"quant_method": "awq", "bits": 4}, r"quant_method='awq' is not served; supported: fbgemm_fp8, compressed-tensors, fp8"),
    ({**quantization_config("fp8_block"), "activation_scheme": "static"}, r"activation_scheme='static' \(static activation"),
    (_ct(weights__type="int"), r"config_groups.group_0.weights is int 8-bit; only float 8-bit \(FP8\) is served"),
    (_ct(weights__strategy="group"), r"weights.strategy='group' is not served; channel, tensor or block"),
    (_ct(input_activations__dynamic=False), r"input_activations has static scales \(dynamic=false\)"),
    ({**quantization_config("ct_channel"), "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
     r"kv_cache_scheme is set"),
    ({**quantization_config("ct_channel"), "format": "pack-quantized"}, r"format='pack-quantized' is not served"),
    (None, r"model.layers.0.mlp.down_proj.weight is FP8 but config.json has no quantization_config"),
    (quantization_config("fp8_block"), r"model.layers.0.mlp.down_proj.weight is FP8 but "
                                        r"model.layers.0.mlp.down_proj.weight_scale_inv \(fp8\) is missing"),
]


@pytest.mark.parametrize("qc, message", REFUSED_CONFIGS)
def test_unserved_configs_are_refused_before_the_model_is_built(ckpts, tmp_path, monkeypatch, qc, message):
    monkeypatch.setattr("serve.models.Qwen2VLForServing.__init__", _never)
    with pytest.raises(ValueError, match=message):
        load_model(_variant(ckpts["fbgemm_fp8"], tmp_path, qc), dtype="bfloat16", quantization="fp8")


def _never(*args, **kwargs):
    raise AssertionError("the model was built before the refusal")


def _tensor_variants(tensors: dict) -> list:
    down = "model.layers.0.mlp.down_proj"
    scale = torch.ones(1)
    return [
        ({"visual.blocks.0.attn.qkv.weight": tensors["visual.blocks.0.attn.qkv.weight"].to(FP8_DTYPE),
          "visual.blocks.0.attn.qkv.weight_scale": scale},
         r"visual.blocks.0.attn.qkv.weight \(torch.float8_e4m3fn\) is quantized, but only the language model's"),
        ({"model.embed_tokens.weight": tensors["model.embed_tokens.weight"].to(FP8_DTYPE)},
         r"model.embed_tokens.weight .* is quantized, but only the language model's"),
        ({down + ".weight": tensors[down + ".weight"].float().to(torch.float8_e5m2)},
         r"down_proj.weight is torch.float8_e5m2; only float8_e4m3fn weights are served"),
        ({down + ".input_scale": scale}, r"down_proj.input_scale: static activation scales are not served"),
        ({down + ".weight_scale": torch.ones(3, 1)}, r"down_proj.weight_scale has shape \[3, 1\]; fbgemm_fp8 "
                                                     r"\(per channel\) over weight \[128, 512\] needs \[128, 1\]"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_fp8_tensors_we_cannot_serve_are_refused_before_the_model_is_built(ckpts, monkeypatch, case):
    tensors = stored_tensors(ckpts["fbgemm_fp8"])
    changes, message = _tensor_variants(tensors)[case]
    monkeypatch.setattr("serve.models.Qwen2VLForServing.__init__", _never)
    with pytest.raises(ValueError, match=message):
        load_model(ckpts["fbgemm_fp8"], dtype="bfloat16", quantization="fp8", weights={**tensors, **changes})
