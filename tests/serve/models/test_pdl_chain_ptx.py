"""The decoder's PDL chain (vlora_kernels/interpreter.py `pdl_chained`) compiled for Hopper on this machine, no GPU
needed. A chained kernel is launched while the kernel before it still runs, so it must wait (griddepcontrol.wait)
before it reads anything: no global load may come before the wait, and the wait is on every program's path, so
the kernel ends only after the one before it. Those that let the next kernel launch early do so before waiting.
Unchained, the same kernels hold neither instruction (and launch as before)."""

from __future__ import annotations

import json

import pytest
from hopper_ptx import compile_ptx

_COMPILE = """
from serve.models.fused import _rms_norm_kernel, _rope_store_kernel, _silu_mul_kernel
from vlora_kernels.fp8_fused import _cast_blocks_fp8_kernel, _rms_norm_fp8_kernel, _silu_mul_fp8_kernel
from vlora_kernels.fp8_decode import _fp8_decode_gemm_reduce_kernel
from serve.forward.decode_kernel import _paged_decode_kernel, _paged_decode_split_kernel

bf16 = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_out_ptr="*bf16", q_ptr="*fp8e4nv",
            s_ptr="*fp32", amax_ptr="*fp32", act_ptr="*bf16")
rope = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", q_out_ptr="*bf16",
            k_cache_ptr="*bf16", v_cache_ptr="*bf16", slot_ptr="*i64")
limits = dict(FP8_LIMIT=448.0, FLOOR=1e-12)
attn = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", o_ptr="*bf16", block_tables_ptr="*i32",
            context_lens_ptr="*i32", q8_ptr="*fp8e4nv", s8_ptr="*fp32", acc_ptr="*fp32", ml_ptr="*fp32")
shape = dict(GROUP=7, HEAD_DIM=128, PAGE=16, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, UPCAST_DOT=False)
cases = {
    "norm": (_rms_norm_kernel, bf16, lambda on: dict(HAS_RES=True, BLOCK=4096, CHAIN=on), ("eps",)),
    "rope_store": (_rope_store_kernel, rope, lambda on: dict(N_HEADS=28, HALF=64, BLOCK=64, CHAIN=on), ()),
    "silu_mul": (_silu_mul_kernel, bf16, lambda on: dict(BLOCK=1024, CHAIN=on), ()),
    "norm_fp8": (_rms_norm_fp8_kernel, bf16,
                 lambda on: dict(limits, HAS_RES=True, BLOCK=4096, LAUNCH_DEPENDENTS=on, WAIT=on), ("eps",)),
    "silu_mul_fp8": (_silu_mul_fp8_kernel, bf16, lambda on: dict(BLOCK=1024, CHAIN=on), ()),
    "cast_blocks_fp8": (_cast_blocks_fp8_kernel, bf16,
                        lambda on: dict(limits, BLOCK=1024, BLOCKS_P2=32, LAUNCH_DEPENDENTS=on, WAIT=on), ()),
    "decode_attention": (_paged_decode_kernel, attn, lambda on: dict(shape, **limits, FP8_OUT=True, CHAIN=on),
                         ("scale_log2",)),
    "decode_attention_split": (_paged_decode_split_kernel, attn,
                               lambda on: dict(shape, SPLITS=4, LAUNCH_DEPENDENTS=on, WAIT=on), ("scale_log2",)),
    "gemm_reduce": (_fp8_decode_gemm_reduce_kernel, dict(part_ptr="*fp32", sx_ptr="*fp32", sw_ptr="*fp32",
                                                         bias_ptr="*bf16", y_ptr="*bf16"),
                    lambda on: dict(SPLIT_K=4, BLOCK=1024, PDL=False, X_FP8=True, HAS_BIAS=True,
                                    LAUNCH_DEPENDENTS=on), ()),
}
out = {f"{name} {on}": ptx(kernel, pointers, consts(on), floats=floats)
       for name, (kernel, pointers, consts, floats) in cases.items() for on in (True, False)}
for x_fp8 in (True, False):  # the reduction behind its GEMM, without a bias: what it reads before its wait
    out[f"reduce_waits x_fp8={x_fp8}"] = ptx(_fp8_decode_gemm_reduce_kernel, cases["gemm_reduce"][1],
                                             dict(SPLIT_K=4, BLOCK=1024, PDL=True, X_FP8=x_fp8, HAS_BIAS=False,
                                                  LAUNCH_DEPENDENTS=True))
sys.stdout.write(json.dumps(out))
"""

WAITERS = ("norm", "rope_store", "silu_mul", "norm_fp8", "silu_mul_fp8", "cast_blocks_fp8", "decode_attention",
           "decode_attention_split")


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return json.loads(compile_ptx(_COMPILE))


@pytest.mark.parametrize("name", WAITERS)
def test_a_chained_kernel_releases_the_next_then_waits_before_any_load(ptx, name):
    code = ptx[f"{name} True"]
    assert code.count("griddepcontrol.wait") == 1
    before, after = code.split("griddepcontrol.wait", 1)
    assert "ld.global" not in before and "ld.global" in after, "a read before the kernel before it has ended"
    assert "st.global" not in before
    assert "griddepcontrol.launch_dependents" in before


@pytest.mark.parametrize("name", WAITERS)
def test_unchained_the_kernels_hold_no_grid_dependency_control(ptx, name):
    assert "griddepcontrol" not in ptx[f"{name} False"]


def test_the_split_k_reduction_lets_the_reader_of_its_output_launch_early(ptx):
    assert "griddepcontrol.launch_dependents" in ptx["gemm_reduce True"]
    assert "griddepcontrol" not in ptx["gemm_reduce False"]


def test_the_reduction_reads_the_activation_scales_only_after_its_wait(ptx):
    """s_x comes from the GEMM's producer, which may still run when the GEMM releases the reduction (a PDL chain):
    before the wait the reduction reads only the weight's scales, so an FP8 activation adds no load there."""
    fp8, plain = (ptx[f"reduce_waits x_fp8={x}"].split("griddepcontrol.wait", 1) for x in (True, False))
    assert fp8[0].count("ld.global") == plain[0].count("ld.global") > 0
    assert fp8[1].count("ld.global") > plain[1].count("ld.global")
