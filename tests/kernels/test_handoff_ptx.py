"""The handoff kernel compiled for Hopper on this machine (no GPU needed): what the interpreter
cannot show, that the in-launch handoff is a release / acquire pair at GPU scope and that v is
read past L1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


# Compiled in a process of its own: this one runs Triton in its interpreter (tests/conftest.py),
# which replaces every kernel by an interpreted function at import.
_COMPILE = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kernels.handoff import _handoff_kernel
pointers = dict(x_ptr="*fp16", a_ptr="*fp16", b_ptr="*fp16", y_ptr="*fp16", v_ptr="*fp32", scales_ptr="*fp32",
                counters_ptr="*i32", token_order_ptr="*i32", seg_slot_ptr="*i32", seg_start_ptr="*i32",
                seg_len_ptr="*i32", ranks_ptr="*i32", slice_offsets_ptr="*i32")
consts = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_R=16, SPLIT_K=4, COL_TILES=2, UPCAST_DOT=False,
              EVEN_K=True, SLICES_MULT16=True, SPIN_LIMIT=0, TICKETS=True, LINE=32)
names = _handoff_kernel.arg_names
signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
source = ASTSource(fn=_handoff_kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
sys.stdout.write(compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"])
"""


def _ptx() -> str:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    if done.returncode != 0 and ("ptxas" in done.stderr or "backend" in done.stderr.lower()):
        pytest.skip(f"cannot compile for CUDA here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_handoff_is_a_release_and_an_acquire_at_gpu_scope():
    ptx = _ptx()
    release = [m.start() for m in re.finditer(r"atom\.global\.gpu\.release\.add", ptx)]
    assert len(release) == 1, "one release increment per shrink item"
    barrier = ptx.rfind("bar.sync", 0, release[0])
    assert "st.global" in ptx[:barrier] and "st.global" not in ptx[barrier:release[0]], \
        "the threads meet after their v stores and before the release, so all of v is stored"
    assert re.search(r"ld\.global\.gpu\.acquire|atom\.global\.gpu\.acquire", ptx), "the wait acquires"
    assert re.search(r"ld\.global\.cg", ptx), "v is read through L2"
    assert "atom.global.gpu.acq_rel.add" in ptx, "tickets are taken with an acq_rel increment"
