"""The fused norm / SiLU-mul + FP8 kernels (vlora_kernels/fp8_fused.py) compiled for Hopper on this machine (no
GPU needed): they compile, round to e4m3 to nearest with saturation and divide by the scale as IEEE,
as vlora_kernels/fp8.py's quantization does, so their bytes match quantize_rows' on a GPU too."""

from __future__ import annotations

import json

import pytest
from hopper_ptx import compile_ptx

_COMPILE = """
from vlora_kernels.fp8_fused import _cast_blocks_fp8_kernel, _rms_norm_fp8_kernel, _silu_mul_fp8_kernel

limits = dict(FP8_LIMIT=448.0, FLOOR=1e-12)
bf16 = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_out_ptr="*bf16", q_ptr="*fp8e4nv",
            s_ptr="*fp32")
out = {"norm": ptx(_rms_norm_fp8_kernel, bf16, dict(limits, HAS_RES=True, BLOCK=4096), floats=("eps",)),
       "silu_amax": ptx(_silu_mul_fp8_kernel, dict(x_ptr="*bf16", out_ptr="*bf16", amax_ptr="*fp32"),
                        dict(BLOCK=1024)),
       "silu": ptx(_cast_blocks_fp8_kernel, dict(act_ptr="*bf16", amax_ptr="*fp32", q_ptr="*fp8e4nv", s_ptr="*fp32"),
                   dict(limits, BLOCK=1024, BLOCKS_P2=32))}
sys.stdout.write(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return json.loads(compile_ptx(_COMPILE))


@pytest.mark.parametrize("kernel, per_thread", [("norm", 4096 // 128), ("silu", 1024 // 128)])
def test_fused_fp8_kernels_round_to_nearest_and_divide_by_the_scale_as_ieee(ptx, kernel, per_thread):
    code = ptx[kernel]
    assert "cvt.rn.satfinite.e4m3x2.f32" in code, "fp32 -> e4m3: round to nearest even, saturating"
    # two IEEE divisions a row: the scale (amax / 448) and its reciprocal; each value / scale is quotient_rn's
    # multiply and two FMAs (tests/kernels/test_quotient_rn.py), not a div.rn.f32 per value. (The norm's mean and
    # the SiLU's 1 / (1 + e^-x) keep the plain `/` of serve/models/fused.py: the activation is that kernel's.)
    assert code.count("div.rn.f32") == 2
    assert code.count("fma.rn.f32") >= 2 * per_thread


def test_the_silu_blocks_compile_and_leave_the_rounding_to_the_second_launch(ptx):
    # the SiLU-mul's first launch writes the model-dtype activation and its blocks' amaxes: no FP8 yet
    assert ptx["silu_amax"] and "e4m3" not in ptx["silu_amax"]
