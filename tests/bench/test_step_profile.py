"""The decode-step breakdown of bench.adapters (profile=true): kernels counted per step and grouped.
With device="cpu" the profiler's events are the CPU operators, so the same code runs anywhere."""

import torch

from bench.step_profile import by_kind, kind_of, profile_step


def test_a_step_is_broken_down_per_call_and_per_kind():
    a, b = torch.randn(96, 64), torch.randn(64, 80)

    def step():
        y = torch.mm(a, b)
        y = torch.mm(y, b.T)
        torch.relu(y)

    prof = profile_step(step, repeats=4, device="cpu")
    mm = [k for k in prof["kernels"] if k["name"] == "aten::mm"]
    assert len(mm) == 1 and mm[0]["launches"] == 2 and mm[0]["kind"] == "matmul"
    assert any(k["name"] == "aten::relu" and k["launches"] == 1 for k in prof["kernels"])
    assert 0 < prof["busy_us"] <= prof["span_us"] and 0 <= prof["idle_share"] < 1
    kinds = by_kind(prof)
    assert kinds["matmul"]["launches"] == 2 and kinds["other"]["launches"] >= 1
    assert abs(sum(v["us"] for v in kinds.values()) - prof["busy_us"]) < 1e-6


def test_kernel_names_are_grouped_by_what_they_compute():
    assert kind_of("_shrink_kernel") == "lora_shrink" and kind_of("_expand_kernel") == "lora_expand"
    assert kind_of("nvjet_hsh_128x64_64x4_1x2_h_bz_coopA_NTN") == "matmul"
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert kind_of("_paged_decode_attention_kernel") == "attention"
    # torch.compile's kernels are elementwise even when their fused names list copies
    assert kind_of("triton_poi_fused_mul_silu_0") == kind_of("triton_poi_fused__to_copy_add_cat_0") == "elementwise"
    assert kind_of("vectorized_layer_norm_kernel") == "norm" and kind_of("Memcpy HtoD (Pinned -> Device)") == "copy"
    assert kind_of("_rotary_qk_kernel") == "elementwise" and kind_of("ncclDevKernel_AllReduce_Sum_bf16") == "other"
