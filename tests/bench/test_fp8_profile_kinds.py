"""bench/fp8_profile.py's grouping of kernel names (GPU names as the profiler reports them, CPU operators)
and its fp8.md section."""

from __future__ import annotations

import pytest

from bench.fp8_profile import kind_of, profile_lines


@pytest.mark.parametrize("name, kind", [
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4>", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "gemm"),
    ("nvjet_hsh_64x8_64x16_2x1_v_bz_TNT", "gemm"),
    ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm90_or_later<GemmUniversal>>", "gemm"),
    ("aten::_scaled_mm", "gemm"), ("aten::linear", "gemm"),
    ("_quantize_rows_kernel", "quantize"), ("fp8_quantize_rows", "quantize"),
    ("_rms_norm_fp8_kernel", "quantize"), ("_silu_mul_fp8_kernel", "quantize"),  # fused: counted as quantize
    ("_rms_norm_kernel", "norm"), ("_paged_decode_kernel", "attention"),
    ("aten::scaled_dot_product_attention", "attention"), ("_sgmv_shrink_kernel", "lora"),
    ("_rope_kernel", "other"), ("_silu_mul_kernel", "other"), ("aten::argmax", "other")])
def test_kernel_names_group_into_kinds(name, kind):
    assert kind_of(name) == kind


def test_the_report_section_gives_each_kinds_share_of_the_span():
    row = dict(section="profile", precision="fp8", batch=32, step="graph replay + LM head", span_us=1000.0,
               busy_us=900.0, idle_share=0.1, top="a|b x1 500us", launches=3.0,
               **{f"{k}_us": v for k, v in dict(gemm=500.0, quantize=100.0, attention=300.0, lora=0.0, norm=0.0,
                                                other=0.0).items()},
               **{f"{k}_calls": 1.0 for k in ("gemm", "quantize", "attention", "lora", "norm", "other")})
    lines = profile_lines([row, dict(section="decode")])
    assert lines[1].startswith("## Decode step profile (graph replay + LM head")
    assert "| fp8 | 32 | 1000 | 10% | 500 (50%, 1 calls) | 100 (10%, 1 calls) | 300 (30%, 1 calls) | 0 | 0 | 0 |" in lines
    assert profile_lines([dict(section="decode")]) == []
