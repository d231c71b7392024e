"""vlora_kernels.merge_fp8_ (Triton, through the interpreter on the CPU) against vlora_kernels.merge_fp8_ref_:
fused and single slices, ranks below and past 16, an untargeted slice, widths that do not fill a
tile, fp32 and bf16 pools; and its input checks."""

from __future__ import annotations

import pytest
import torch

from vlora_kernels import FP8_DTYPE, dequantize, merge_fp8_, merge_fp8_ref_, quantize_weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernel: on the GPU, else interpreted


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths,k,ranks", [((40, 8, 24), 200, (12, 0, 5)), ((33,), 130, (20,)),
                                            ((16, 16), 64, (16, 1))])
def test_triton_fp8_merge_matches_reference(pool_dtype, widths, k, ranks):
    g = torch.Generator().manual_seed(sum(widths) + k)
    layers, slots, r_max, slot = 2, 3, 32, 1
    w = (torch.randn(layers, sum(widths), k, generator=g) * 0.1).to(DEVICE)
    q, s = quantize_weight(w)
    lora_a = torch.randn(layers, len(widths), slots, r_max, k, generator=g).to(dtype=pool_dtype, device=DEVICE)
    lora_b = (torch.randn(layers, slots, sum(widths), r_max, generator=g) * 0.05).to(dtype=pool_dtype, device=DEVICE)
    rank_table = torch.tensor([[rk] * slots for rk in ranks], dtype=torch.int32, device=DEVICE)
    scales = torch.tensor([0.5, 2.0, 1.0], device=DEVICE)
    offsets = [0]
    for width in widths:
        offsets.append(offsets[-1] + width)
    q_ref, s_ref = q.clone(), s.clone()
    merge_fp8_ref_(q_ref, s_ref, lora_a, lora_b, slot, rank_table, scales, offsets)
    merge_fp8_(q, s, lora_a, lora_b, slot, rank_table, scales, offsets)
    # the same fp32 values up to summation order: scales within float rounding, codes within one step
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    codes = (q.view(torch.uint8).int() - q_ref.view(torch.uint8).int()).abs()
    assert codes.max() <= 1 and (codes > 0).float().mean() < 0.01
    torch.testing.assert_close(dequantize(q, s), dequantize(q_ref, s_ref), rtol=2.0 ** -3, atol=1e-6)
    assert not torch.equal(q.view(torch.uint8), quantize_weight(w)[0].view(torch.uint8))  # it merged


def test_fp8_merge_refuses_a_weight_that_is_not_fp8():
    w = torch.zeros(1, 16, 16)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        merge_fp8_(w, torch.ones(1, 16), torch.zeros(1, 1, 1, 16, 16), torch.zeros(1, 1, 16, 16), 0,
                   torch.ones(1, 1, dtype=torch.int32), torch.ones(1), [0, 16])
    with pytest.raises(ValueError, match="weight_scale must be fp32"):
        merge_fp8_(w.to(FP8_DTYPE), torch.ones(1, 8), torch.zeros(1, 1, 1, 16, 16), torch.zeros(1, 1, 16, 16), 0,
                   torch.ones(1, 1, dtype=torch.int32), torch.ones(1), [0, 16])
