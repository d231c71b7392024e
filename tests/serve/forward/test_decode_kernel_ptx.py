"""serve/forward/decode_kernel.py's paged decode attention compiled for Hopper on this machine (no GPU needed),
with and without the FP8 rows of its output (the interpreter runs code the compiler refuses, such as a
global Python float inside the kernel): with them, each program rounds its kv head group's values to e4m3 to
nearest with saturation after an IEEE division by the group's scale, and stores them as bytes."""

from __future__ import annotations

import json

import pytest
from hopper_ptx import compile_ptx

_COMPILE = """
from serve.forward.decode_kernel import _paged_decode_combine_kernel, _paged_decode_kernel as kernel
from serve.forward.decode_kernel import _paged_decode_split_kernel

pointers = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", o_ptr="*bf16", block_tables_ptr="*i32",
                context_lens_ptr="*i32", q8_ptr="*fp8e4nv", s8_ptr="*fp32")
shape = dict(GROUP=7, HEAD_DIM=128, PAGE=16, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, UPCAST_DOT=False,
             FP8_LIMIT=448.0, FLOOR=1e-12)
out = {"plain": ptx(kernel, pointers, dict(shape, FP8_OUT=False, CHAIN=False), floats=("scale_log2",)),
       "fp8": ptx(kernel, pointers, dict(shape, FP8_OUT=True, CHAIN=False), floats=("scale_log2",))}
split_shape = {k: v for k, v in shape.items() if k not in ("FP8_LIMIT", "FLOOR")}
out["split"] = ptx(_paged_decode_split_kernel, dict(pointers, acc_ptr="*fp32", ml_ptr="*fp32"),
                   dict(split_shape, SPLITS=4, LAUNCH_DEPENDENTS=True, WAIT=False), floats=("scale_log2",))
combine_shape = {k: v for k, v in shape.items() if k not in ("PAGE", "BLOCK_N", "UPCAST_DOT")}
out["combine"] = ptx(_paged_decode_combine_kernel, dict(pointers, acc_ptr="*fp32", ml_ptr="*fp32"),
                     dict(combine_shape, SPLITS=4, FP8_OUT=True, PDL=True, LAUNCH_DEPENDENTS=False))
sys.stdout.write(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return json.loads(compile_ptx(_COMPILE))


def test_the_decode_attention_writes_its_fp8_rows_only_when_asked(ptx):
    assert "e4m3" not in ptx["plain"] and "div.rn.f32" not in ptx["plain"]
    code = ptx["fp8"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in code, "fp32 -> e4m3: round to nearest even, saturating"
    assert "div.rn.f32" in code  # the scale (amax / 448) and each value / scale, as vlora_kernels/fp8.py quantizes
    assert "st.global.b8" in code or "st.global.v2.b8" in code or "st.global.v4.b8" in code or "st.global.b16" in code


def test_the_split_context_releases_its_combine_which_waits_for_the_partials_on_the_device(ptx):
    assert "griddepcontrol.launch_dependents" in ptx["split"] and "griddepcontrol.wait" not in ptx["split"]
    combine = ptx["combine"]
    assert combine.count("griddepcontrol.wait") == 1
    before, after = combine.split("griddepcontrol.wait", 1)
    assert "ld.global" not in before and "ld.global" in after  # every partial read after the wait
    assert "cvt.rn.satfinite.e4m3x2.f32" in after  # the combine writes the FP8 rows
