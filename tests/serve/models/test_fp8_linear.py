"""FP8 projections (serve/models/fp8.py) on the CPU: the layer against a fp32 matmul of its dequantized
weight, quantization at load over the tiny model, and the configuration's refusals."""

from __future__ import annotations

import pytest
import torch

from vlora_kernels.fp8 import FP8_DTYPE, dequantize, quantize_rows_ref
from serve import Engine, EngineConfig
from serve.models import Linear, load_model
from serve.models import fp8 as fp8_module
from serve.models.fp8 import Fp8Linear, check_quantization


def _linear(dtype=torch.bfloat16, bias=True) -> Linear:
    lin = Linear(64, (32, 16, 16), ("q_proj", "k_proj", "v_proj"), bias=bias, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    lin.weight.data.copy_(torch.randn(64, 64, generator=g) * 0.05)
    if bias:
        lin.bias.data.copy_(torch.randn(64, generator=g))
    return lin


def test_fp8_linear_matches_fp32_matmul_of_its_dequantized_weight():
    lin = _linear()
    layer = Fp8Linear(lin)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (64,)
    assert layer.output_slices == lin.output_slices and layer.slice_range("k_proj") == (32, 48)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (7, 64)
    q_x, s_x = quantize_rows_ref(x)
    ref = dequantize(q_x, s_x.squeeze(1)) @ layer.dequantized().T + lin.bias.float()
    torch.testing.assert_close(y.float(), ref, atol=2.0 ** -8 * ref.abs().max().item(), rtol=2.0 ** -8)
    exact = lin(x).float()  # the bf16 layer: FP8's error is a few percent of the output's scale
    assert (y.float() - exact).abs().max() < 0.1 * exact.abs().max()


def test_load_model_quantizes_every_projection_once(tiny_zoo):
    model, _ = load_model(tiny_zoo["qwen2_vl_tiny"], dtype="bfloat16", quantization="fp8")
    bf16, _ = load_model(tiny_zoo["qwen2_vl_tiny"], dtype="bfloat16")
    lm, ref = model.language_model, bf16.language_model
    kinds = [(layer, kind, type(m)) for layer, kind, m in lm.projections()]
    assert kinds and all(t is Fp8Linear for _, _, t in kinds)
    for (_, _, q), (_, _, w) in zip(lm.projections(), ref.projections()):
        assert q.weight.element_size() == 1 and w.weight.element_size() == 2
        # half an e4m3 step: 2**-4 of the value, or 2**-10 of the row's scale among the subnormals
        bound = torch.maximum(w.weight.float().abs() * 2.0 ** -4, q.weight_scale[:, None] * 2.0 ** -10)
        assert bool(((q.dequantized() - w.weight.float()).abs() <= bound * 1.0001).all())
    assert lm.embed_tokens.weight.dtype == torch.bfloat16  # only the projections change


def test_config_refuses_unknown_quantization_and_tensor_parallel_fp8():
    with pytest.raises(ValueError, match="quantization='int4' is not one of none, fp8"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        EngineConfig(quantization="fp8", tensor_parallel_size=2)
    assert EngineConfig(quantization=None).quantization == "none"
    assert EngineConfig.from_dict({"quantization": "fp8"}).quantization == "fp8"


def test_cpu_engine_refuses_fp8_before_loading_anything(tmp_path):
    missing = tmp_path / "no_checkpoint_here"  # the refusal comes first: no file is looked at
    with pytest.raises(ValueError, match=r"quantization=fp8 needs a GPU with FP8 tensor cores \(compute "
                                         r"capability >= 8.9\); this engine runs on the CPU"):
        Engine(missing, EngineConfig(device="cpu", quantization="fp8"))
    check_quantization("none", torch.device("cpu"))


def test_allow_cpu_is_the_test_only_way_through(monkeypatch):
    monkeypatch.setattr(fp8_module, "ALLOW_CPU", True)
    check_quantization("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="is not one of"):
        check_quantization("fp4", torch.device("cpu"))
