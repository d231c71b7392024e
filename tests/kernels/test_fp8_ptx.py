"""The FP8 kernels compiled for Hopper on this machine (no GPU needed): what the interpreter cannot
show, that the GPU rounds to e4m3 to nearest with saturation and divides as IEEE (as torch does,
so the per-token scales and codes match the PyTorch reference byte for byte), and that the merge's
B @ A runs on the tensor cores."""

from __future__ import annotations

import json
import re

import pytest
from hopper_ptx import compile_ptx

_COMPILE = """
from vlora_kernels.fp8 import _quantize_rows_kernel
from vlora_kernels.fp8_merge import _merge_fp8_kernel

limits = dict(FP8_LIMIT=448.0, FLOOR=1e-12)
out = {"quantize": ptx(_quantize_rows_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"),
                       dict(limits, BLOCK_K=2048, ONE_PASS=False)),
       "quantize_one_pass": ptx(_quantize_rows_kernel, dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"),
                                dict(limits, BLOCK_K=4096, ONE_PASS=True)),
       "merge": ptx(_merge_fp8_kernel, dict(w_ptr="*fp8e4nv", q_ptr="*fp8e4nv", s_ptr="*fp32", a_ptr="*bf16",
                                            b_ptr="*bf16", scales_ptr="*fp32"),
                    dict(limits, R_PAD=16, BLOCK_N=32, BLOCK_K=128, UPCAST_DOT=False))}
sys.stdout.write(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return json.loads(compile_ptx(_COMPILE))


@pytest.mark.parametrize("kernel", ["quantize", "quantize_one_pass", "merge"])
def test_fp8_kernels_round_to_nearest_and_divide_as_ieee(ptx, kernel):
    code = ptx[kernel]
    assert "cvt.rn.satfinite.e4m3x2.f32" in code, "fp32 -> e4m3: round to nearest even, saturating"
    assert "div.rn.f32" in code and "div.full.f32" not in code, "a plain `/` would be the approximate division"


def test_fp8_merge_multiplies_on_the_tensor_cores(ptx):
    assert re.search(r"\bwgmma\.|\bmma\.sync\.", ptx["merge"])
