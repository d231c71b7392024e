"""The FP8 kernels compiled for Hopper on this machine (no GPU needed): what the interpreter cannot
show, that the GPU rounds to e4m3 to nearest with saturation and divides as IEEE (as torch does,
so the per-token scales and codes match the PyTorch reference byte for byte), and that the merge's
B @ A runs on the tensor cores."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Compiled in a process of its own: this one runs Triton in its interpreter (tests/conftest.py).
_COMPILE = """
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kernels.fp8 import _quantize_rows_kernel
from kernels.fp8_merge import _merge_fp8_kernel

def ptx(kernel, pointers, consts):
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    return compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

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
    import json

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    if done.returncode != 0 and ("ptxas" in done.stderr or "backend" in done.stderr.lower()):
        pytest.skip(f"cannot compile for CUDA here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("kernel", ["quantize", "quantize_one_pass", "merge"])
def test_fp8_kernels_round_to_nearest_and_divide_as_ieee(ptx, kernel):
    code = ptx[kernel]
    assert "cvt.rn.satfinite.e4m3x2.f32" in code, "fp32 -> e4m3: round to nearest even, saturating"
    assert "div.rn.f32" in code and "div.full.f32" not in code, "a plain `/` would be the approximate division"


def test_fp8_merge_multiplies_on_the_tensor_cores(ptx):
    assert re.search(r"\bwgmma\.|\bmma\.sync\.", ptx["merge"])
