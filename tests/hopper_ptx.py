"""Kernels compiled for Hopper (sm_90) on this machine, no GPU needed, for the tests that read their PTX:
what the interpreter cannot show (rounding, division, memory ordering, tensor-core use).

`compile_ptx(body)` runs `PRELUDE + body` in a process of its own (this one runs Triton in its
interpreter, tests/conftest.py, which replaces every kernel by an interpreted function at import) and
returns what the body writes to stdout; the test is skipped where no CUDA backend or ptxas is
installed. The body calls `ptx(kernel, pointers, consts, floats=())`: the kernel's PTX, each argument
typed as `pointers` names it, a constexpr with its value in `consts`, fp32 if in `floats`, else i32.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PRELUDE = """
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

def ptx(kernel, pointers, consts, floats=()):
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in floats else "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    return compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
"""


def compile_ptx(body: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", PRELUDE + body], capture_output=True, text=True, env=env,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    if done.returncode != 0 and ("ptxas" in done.stderr or "backend" in done.stderr.lower()):
        pytest.skip(f"cannot compile for CUDA here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
