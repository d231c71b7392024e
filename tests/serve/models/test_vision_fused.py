"""The vision towers' Triton kernels (interpreter on CPU) against the towers' PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from serve.models.qwen_vision import QwenVisionTower, _quick_gelu, _rotary_qk
from serve.models.vision_fused import quick_gelu, rotary_qk

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cos_sin(rows: int, dim: int, g):
    from types import SimpleNamespace

    vc = SimpleNamespace(embed_dim=dim * 2, hidden_size=8, mlp_ratio=1, num_heads=2, spatial_merge_size=2,
                         patch_size=14, temporal_patch_size=2, in_channels=3, depth=1, hidden_act="quick_gelu",
                         window_size=112)
    tower = QwenVisionTower(vc, "qwen2_vl")
    positions = torch.randint(0, 40, (rows, 2), generator=g)
    return tower.rotary(positions.to(DEV))


@pytest.mark.parametrize("heads,dim", [(2, 16), (3, 80)])  # 80: the Qwen towers' head size (not a power of two)
def test_rotary_qk_matches_the_reference_on_the_fused_projections_view(heads, dim):
    g = torch.Generator().manual_seed(0)
    rows = 13
    cos, sin = _cos_sin(rows, dim, g)
    assert cos.shape == (rows, 1, 1, dim) and cos.dtype == torch.float32
    # a row of the projection is [q | k | v] with a bias-free layout gap: a strided view, as the tower makes it
    flat = torch.randn(rows, 3 * heads * dim + 8, generator=g).to(DEV)
    qkv = flat[:, :3 * heads * dim].view(rows, 3, heads, dim)
    got = rotary_qk(qkv, cos, sin)
    assert got.shape == (rows, 2, heads, dim) and got.is_contiguous()
    torch.testing.assert_close(got, _rotary_qk(qkv, cos, sin), atol=1e-6, rtol=1e-6)
    # the value half of qkv is not read: changing it changes nothing
    qkv[:, 2] += 1.0
    torch.testing.assert_close(rotary_qk(qkv, cos, sin), got, atol=0, rtol=0)


def test_rotary_qk_rounds_once_to_bfloat16():
    g = torch.Generator().manual_seed(1)
    cos, sin = _cos_sin(9, 80, g)
    qkv = torch.randn(9, 3, 4, 80, generator=g).to(DEV, torch.bfloat16)
    got = rotary_qk(qkv, cos, sin)
    assert got.dtype == torch.bfloat16
    # the interpreter truncates fp32 -> bf16 where a GPU rounds: one bf16 ulp
    torch.testing.assert_close(got.float(), _rotary_qk(qkv, cos, sin).float(), atol=1e-2, rtol=2 ** -7)


def test_rotary_qk_refuses_what_it_cannot_read():
    qkv = torch.randn(4, 3, 2, 8)
    cos = torch.randn(4, 1, 1, 8)
    with pytest.raises(ValueError, match="rotary_qk needs"):
        rotary_qk(qkv, cos.double(), cos.double())
    with pytest.raises(ValueError, match="rotary_qk needs"):
        rotary_qk(qkv[:, :2], cos, cos)


# bf16: one ulp (the interpreter truncates where a GPU rounds)
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-6, 1e-5), (torch.bfloat16, 2e-2, 2 ** -7)])
def test_quick_gelu_matches_the_reference(dtype, atol, rtol):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(7, 5000, generator=g) * 4).to(DEV, dtype)  # more than one block, a ragged last one
    torch.testing.assert_close(quick_gelu(x), _quick_gelu(x.float()).to(dtype), atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match="contiguous"):
        quick_gelu(x.t())
