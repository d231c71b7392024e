"""The fused norm / SiLU-mul + FP8 kernels (kernels/fp8_fused.py) compiled for Hopper on this machine (no
GPU needed): they compile, round to e4m3 to nearest with saturation and divide by the scale as IEEE,
as kernels/fp8.py's quantization does, so their bytes match quantize_rows' on a GPU too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Compiled in a process of its own: this one runs Triton in its interpreter (tests/conftest.py).
_COMPILE = """
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kernels.fp8_fused import _rms_norm_fp8_kernel, _silu_mul_fp8_kernel

def ptx(kernel, pointers, consts, floats=()):
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in floats else "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    return compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

limits = dict(FP8_LIMIT=448.0, FLOOR=1e-12)
bf16 = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_out_ptr="*bf16", q_ptr="*fp8e4nv",
            s_ptr="*fp32")
out = {"norm": ptx(_rms_norm_fp8_kernel, bf16, dict(limits, HAS_RES=True, BLOCK=4096), floats=("eps",)),
       "silu": ptx(_silu_mul_fp8_kernel, bf16, dict(limits, BLOCK=2048))}
sys.stdout.write(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    if done.returncode != 0 and ("ptxas" in done.stderr or "backend" in done.stderr.lower()):
        pytest.skip(f"cannot compile for CUDA here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("kernel", ["norm", "silu"])
def test_fused_fp8_kernels_round_to_nearest_and_divide_by_the_scale_as_ieee(ptx, kernel):
    code = ptx[kernel]
    assert "cvt.rn.satfinite.e4m3x2.f32" in code, "fp32 -> e4m3: round to nearest even, saturating"
    # the scale (amax / 448) and each value / scale: div_rn. (The norm's mean and the SiLU's 1 / (1 + e^-x)
    # keep the plain `/` of serve/models/fused.py, so the activation is that kernel's, bit for bit.)
    assert code.count("div.rn.f32") >= 2
