"""The handoff kernel compiled for Hopper on this machine (no GPU needed): what the interpreter
cannot show, that the in-launch handoff is a release / acquire pair at GPU scope and that v is
read past L1."""

from __future__ import annotations

import re

from hopper_ptx import compile_ptx

_COMPILE = """
from vlora_kernels.handoff import _handoff_kernel
pointers = dict(x_ptr="*fp16", a_ptr="*fp16", b_ptr="*fp16", y_ptr="*fp16", v_ptr="*fp32", scales_ptr="*fp32",
                counters_ptr="*i32", token_order_ptr="*i32", seg_slot_ptr="*i32", seg_start_ptr="*i32",
                seg_len_ptr="*i32", ranks_ptr="*i32", slice_offsets_ptr="*i32")
consts = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, BLOCK_R=16, SPLIT_K=4, COL_TILES=2, UPCAST_DOT=False,
              EVEN_K=True, SLICES_MULT16=True, SPIN_LIMIT=0, TICKETS=True, LINE=32)
sys.stdout.write(ptx(_handoff_kernel, pointers, consts))
"""


def test_the_handoff_is_a_release_and_an_acquire_at_gpu_scope():
    ptx = compile_ptx(_COMPILE)
    release = [m.start() for m in re.finditer(r"atom\.global\.gpu\.release\.add", ptx)]
    assert len(release) == 1, "one release increment per shrink item"
    barrier = ptx.rfind("bar.sync", 0, release[0])
    assert "st.global" in ptx[:barrier] and "st.global" not in ptx[barrier:release[0]], \
        "the threads meet after their v stores and before the release, so all of v is stored"
    assert re.search(r"ld\.global\.gpu\.acquire|atom\.global\.gpu\.acquire", ptx), "the wait acquires"
    assert re.search(r"ld\.global\.cg", ptx), "v is read through L2"
    assert "atom.global.gpu.acq_rel.add" in ptx, "tickets are taken with an acq_rel increment"
