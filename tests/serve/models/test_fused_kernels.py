"""Fused RMSNorm(+residual), RoPE and SiLU-and-multiply Triton kernels (interpreter on CPU) against
the PyTorch path."""

from __future__ import annotations

import pytest
import torch

from serve.forward.attention import store_kv
from serve.models.fused import rms_norm, rope, rope_store, silu_and_mul
from serve.models.layers import RMSNorm
from serve.models.layers import silu_and_mul as torch_silu_and_mul
from serve.models.rope import RotaryEmbedding, apply_rotary

# the interpreter on a CPU machine, the compiled kernels where a GPU is
DEV = "cuda" if torch.cuda.is_available() else "cpu"


# bfloat16 bounds allow a few ulps: the interpreter truncates float32 -> bfloat16 where a GPU rounds
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 5e-2, 2e-2)])
@pytest.mark.parametrize("dim", [128, 96])
def test_rms_norm_kernel_matches_the_torch_norm(dtype, atol, rtol, dim):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, dim, generator=g).to(DEV, dtype)
    residual = torch.randn(7, dim, generator=g).to(DEV, dtype)
    norm = RMSNorm(dim, 1e-6, dtype, DEV)
    norm.weight.data.copy_(torch.rand(dim, generator=g) + 0.5)
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6), norm(x), atol=atol, rtol=rtol)
    y, r = rms_norm(x, norm.weight, 1e-6, residual)
    want_y, want_r = norm(x, residual)
    # exact on a GPU; Triton's interpreter truncates float32 -> bfloat16 instead of rounding (1 ulp)
    torch.testing.assert_close(r, want_r, atol=0, rtol=0 if dtype == torch.float32 else 2 ** -7)
    torch.testing.assert_close(y, want_y, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_rope_kernel_matches_the_torch_rotation_on_strided_views(dtype, atol):
    g = torch.Generator().manual_seed(1)
    t, heads, kv_heads, d = 9, 4, 2, 32
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(DEV, dtype)
    q = qkv[:, :heads * d].view(t, heads, d)  # strided views into a fused projection, as in the model
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    positions = torch.stack([torch.arange(t), torch.arange(t) // 2, torch.arange(t) % 3]) + 5
    cos, sin = (c.to(DEV) for c in RotaryEmbedding(d, 1e6, (4, 6, 6)).cos_sin(positions, dtype))
    for x in (q, k):
        got = rope(x, cos, sin)
        assert got.is_contiguous()
        torch.testing.assert_close(got, apply_rotary(x, cos, sin), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [32, 24])  # a power of two, and a half (12) that is not
def test_rope_store_writes_what_rope_and_store_kv_write(dtype, d):
    # the fused launch against the two it replaces, bit for bit: the rotated q, and both caches whole (the
    # token's slots written, every other slot untouched, slots in no order and one of them the padding slot)
    g = torch.Generator().manual_seed(2)
    t, heads, kv_heads, blocks, block_size = 5, 4, 2, 3, 4
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(DEV, dtype)
    q = qkv[:, :heads * d].view(t, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    cos, sin = (c.to(DEV) for c in RotaryEmbedding(d, 1e6, None).cos_sin(torch.arange(t) + 7, dtype))
    slots = torch.tensor([9, 2, 11, 0, 5], device=DEV)
    caches = [torch.randn(blocks, block_size, kv_heads, d, generator=g).to(DEV, dtype) for _ in range(2)]
    want_k, want_v = (c.clone() for c in caches)
    store_kv(rope(k, cos, sin), v, want_k, want_v, slots)
    got_q = rope_store(q, k, v, cos, sin, caches[0], caches[1], slots)
    assert torch.equal(got_q, rope(q, cos, sin)) and got_q.is_contiguous()
    assert torch.equal(caches[0], want_k) and torch.equal(caches[1], want_v)


def test_rope_store_names_what_does_not_fit():
    q, kv = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8)
    cos = torch.zeros(2, 8)
    cache = torch.zeros(3, 4, 2, 8)
    with pytest.raises(ValueError, match="rope_store needs .* slots \\(2,\\) torch.int32"):
        rope_store(q, kv, kv, cos, cos, cache, cache.clone(), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="caches \\(3, 4, 3, 8\\)"):
        rope_store(q, kv, kv, cos, cos, torch.zeros(3, 4, 3, 8), torch.zeros(3, 4, 3, 8), torch.zeros(2).long())


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("width", [96, 1100, 3000])  # one block, several blocks, a partial last block
def test_silu_and_mul_kernel_matches_torch(dtype, atol, width):
    g = torch.Generator().manual_seed(width)
    x = (3 * torch.randn(5, 2 * width, generator=g)).to(DEV, dtype)
    got = silu_and_mul(x)
    torch.testing.assert_close(got, torch_silu_and_mul(x), atol=atol, rtol=atol)
    strided = torch.randn(5, 4 * width, generator=g).to(DEV, dtype)[:, : 2 * width]  # rows apart in memory
    torch.testing.assert_close(silu_and_mul(strided), torch_silu_and_mul(strided), atol=atol, rtol=atol)
    assert silu_and_mul(x[:0]).shape == (0, width)


def _to_bf16(t: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 -> float32 as this device's kernels do it: Triton's interpreter truncates (drops the
    low 16 bits), a GPU rounds to nearest even."""
    if DEV == "cuda":
        return t.to(torch.bfloat16).float()
    return (t.contiguous().view(torch.int32) & -65536).view(torch.float32)


def test_silu_is_rounded_to_the_model_dtype_before_the_multiply_as_torch_does():
    # bf16 silu(gate) * up is two roundings in torch (F.silu's result, then the product's); the tolerance tests
    # above cannot tell one rounding from two. Rounded once, the product matches about half the elements.
    from vlora_kernels.fp8_fused import silu_mul_fp8

    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(16, 2 * 1100, generator=g)).to(DEV, torch.bfloat16)
    gate, up = x.float().chunk(2, dim=-1)
    silu = gate / (1.0 + torch.exp(-gate))
    twice, once = _to_bf16(_to_bf16(silu) * up), _to_bf16(silu * up)
    for got in (silu_and_mul(x).float(), silu_mul_fp8(x).float()):
        assert (got == twice).float().mean() > 0.999  # exp may differ in the last bit of a float32 now and then
        assert (got == once).float().mean() < 0.9


def test_fused_kernels_name_bad_shapes():
    with pytest.raises(ValueError, match="silu_and_mul needs"):
        silu_and_mul(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="rms_norm needs"):
        rms_norm(torch.zeros(2, 3, 4), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="rope needs"):
        rope(torch.zeros(2, 1, 8), torch.zeros(3, 8), torch.zeros(3, 8))
