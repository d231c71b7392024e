"""vlora_kernels/fp8_decode.py's GEMM compiled for Hopper on this machine (no GPU needed): the dot is an FP8
wgmma with the weight's channels as its M and the tokens as its N, each wgmma's sum promoted to fp32,
and both operands stream in 16-byte cp.async copies, pipelined. The weight-only variant (bf16 tokens)
widens each FP8 weight tile in registers and feeds it to a bf16 wgmma from there."""

from __future__ import annotations

import json
import re

import pytest
from hopper_ptx import compile_ptx

# Compiled as a launch specializes it: the pointers, sizes and strides divisible by 16 (the 7B's K and
# N are), so the K-masked loads may be 16 bytes wide. (hopper_ptx's ptx() declares no divisibility.)
_COMPILE = """
from vlora_kernels.fp8_decode import _fp8_decode_gemm_kernel as kernel, _fp8_decode_gemm_reduce_kernel

names = kernel.arg_names
aligned = ("x_ptr", "w_ptr", "sx_ptr", "sw_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn",
           "stride_os", "stride_om")

def launch_ptx(out_ptr, consts, warps=4, stages=4, x_ptr="*fp8e4nv"):
    pointers = dict(x_ptr=x_ptr, w_ptr="*fp8e4nv", sx_ptr="*fp32", sw_ptr="*fp32", bias_ptr="*bf16", out_ptr=out_ptr)
    signature = {n: "constexpr" if n in consts else pointers.get(n, "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages)).asm["ptx"]

base = dict(K_TILES_PER_SPLIT=7, BLOCK_K=128, UPCAST_DOT=False, X_FP8=True, WAIT_FOR_INPUTS=False, PREFETCH_LINES=1,
            GROUP_TILES=0, HAS_BIAS=False)
wo = dict(base, X_FP8=False)
out = {"m16_n64": launch_ptx("*bf16", dict(base, BLOCK_M=16, BLOCK_N=64, SPLIT=False, LAUNCH_DEPENDENTS=False)),
       "m64_n128_split": launch_ptx("*fp32", dict(base, BLOCK_M=64, BLOCK_N=128, SPLIT=True, LAUNCH_DEPENDENTS=True)),
       "w_m16_n64": launch_ptx("*bf16", dict(wo, BLOCK_M=16, BLOCK_N=64, SPLIT=False, LAUNCH_DEPENDENTS=False),
                               x_ptr="*bf16"),
       "w_m64_n128_split": launch_ptx("*fp32", dict(wo, BLOCK_M=64, BLOCK_N=128, SPLIT=True, LAUNCH_DEPENDENTS=True),
                                      x_ptr="*bf16", stages=3),
       "m32_n64_waits": launch_ptx("*bf16", dict(base, BLOCK_M=32, BLOCK_N=64, SPLIT=False, LAUNCH_DEPENDENTS=False,
                                                 WAIT_FOR_INPUTS=True, PREFETCH_LINES=4)),
       # the 7B's o_proj behind the decode attention: one kv head group (7 tiles) a split, scaled as it ends
       "m32_n64_grouped": launch_ptx("*fp32", dict(base, BLOCK_M=32, BLOCK_N=64, SPLIT=True, LAUNCH_DEPENDENTS=True,
                                                   GROUP_TILES=7)),
       # a channel tile under a wgmma's 64 (fp8_decode.BLOCK_NS), unsplit, 2 warps
       "m32_n16": launch_ptx("*bf16", dict(base, BLOCK_M=32, BLOCK_N=16, SPLIT=False, LAUNCH_DEPENDENTS=False),
                             warps=2),
       "m32_n64_bias": launch_ptx("*bf16", dict(base, BLOCK_M=32, BLOCK_N=64, SPLIT=False, LAUNCH_DEPENDENTS=False,
                                                HAS_BIAS=True)),
       "reduce": ptx(_fp8_decode_gemm_reduce_kernel, dict(part_ptr="*fp32", sx_ptr="*fp32", sw_ptr="*fp32",
                                                          bias_ptr="*bf16", y_ptr="*bf16"),
                     dict(SPLIT_K=4, BLOCK=1024, PDL=True, X_FP8=True, HAS_BIAS=True, LAUNCH_DEPENDENTS=False))}
sys.stdout.write(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return json.loads(compile_ptx(_COMPILE))


@pytest.mark.parametrize("variant, tokens", [("m16_n64", 16), ("m64_n128_split", 64), ("m32_n64_grouped", 32),
                                             ("m32_n64_bias", 32)])
def test_decode_gemm_is_an_fp8_wgmma_over_channels_by_tokens(ptx, variant, tokens):
    code = ptx[variant]
    # m64: 64 weight channels a warpgroup; n: the padded tokens; k32 of e4m3 by e4m3 into f32
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.e4m3\.e4m3", code))
    assert shapes == {f"m64n{tokens}k32"}, sorted(set(re.findall(r"\bw?gmma[.\w]*|\bmma\.sync[.\w]*", code)))
    assert "mma.sync" not in code  # no fp16 mma of upcast operands (what max_num_imprecise_acc=0 gives)
    # each wgmma's sum is added into the fp32 accumulator (max_num_imprecise_acc=32): one add.f32 per
    # accumulator register per wgmma (BLOCK_K / 32 = 4 a tile), no fewer
    per_thread = tokens * (128 if variant == "m64_n128_split" else 64) // 128
    assert code.count("add.f32") >= 4 * per_thread


@pytest.mark.parametrize("variant, tokens", [("w_m16_n64", 16), ("w_m64_n128_split", 64)])
def test_weight_only_gemm_widens_the_fp8_tile_in_registers_into_a_bf16_wgmma(ptx, variant, tokens):
    code = ptx[variant]
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.bf16\.bf16 \{[^}]*\}, (\S+)", code)
    assert {shape for shape, _ in wgmma} == {f"m64n{tokens}k16"}, sorted(set(re.findall(r"\bw?gmma[.\w]*", code)))
    # the A operand (the weight's channels) is a register list: widened after its load, never written back
    assert all(a.startswith("{") for _, a in wgmma) and "mma.sync" not in code and ".e4m3.e4m3" not in code
    assert "cvt.rn.f16x2.e4m3x2" in code  # two e4m3 values a conversion (exact in f16, then in bf16)


def test_a_channel_tile_under_64_widens_its_fp8_tiles_into_an_f16_mma_sync(ptx):
    code = ptx["m32_n16"]
    shapes = set(re.findall(r"mma\.sync\.aligned\.(m\d+n\d+k\d+\.row\.col\.f32\.\w+\.\w+)", code))
    assert shapes == {"m16n8k16.row.col.f32.f16.f16"} and "wgmma" not in code
    assert "cvt.rn.f16x2.e4m3x2" in code  # both operands widened, exactly: e4m3 values are f16 values
    # 16 channels x 32 tokens x 128 of K a tile: 1 x 4 x 8 = 32 mma over 2 warps, 16 each (one tile a loop trip)
    assert code.count("mma.sync.aligned") == 16


@pytest.mark.parametrize("variant", ["m16_n64", "m64_n128_split", "w_m16_n64", "w_m64_n128_split", "m32_n64_grouped",
                                     "m32_n16"])
def test_decode_gemm_streams_its_tiles_in_16_byte_async_copies(ptx, variant):
    code = ptx[variant]
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], (0x\w+)", code)
    assert copies and set(copies) == {"0x10"}
    assert "cp.async.wait_group" in code and "ld.global.b8" not in code  # pipelined, no byte loads


def test_split_k_reduction_is_launched_behind_the_gemm_and_waits_for_it_on_the_device(ptx):
    assert "griddepcontrol.launch_dependents" in ptx["m64_n128_split"]
    assert "griddepcontrol" not in ptx["m16_n64"]  # one launch: nothing behind it to release
    reduce = ptx["reduce"]
    # the scales and the bias are loaded before the wait, the partials after it
    assert "griddepcontrol.wait" in reduce
    before, after = reduce.split("griddepcontrol.wait", 1)
    assert "ld.global" in before and "ld.global" in after
    assert "ld.global.b16" in before and "ld.global.b16" not in after  # the bf16 bias: before the wait


def test_a_gemm_launched_behind_its_producer_prefetches_its_weight_then_waits_before_any_load_or_store(ptx):
    """GEMM_PDL: the program's first weight lines are asked of L2 (4 lines of each of its 64 rows), then
    griddepcontrol.wait; every load of x or the weight, and every store, comes after the wait."""
    code = ptx["m32_n64_waits"]
    assert code.count("griddepcontrol.wait") == 1 and "griddepcontrol.launch_dependents" not in code
    before, after = code.split("griddepcontrol.wait", 1)
    assert before.count("prefetch.global.L2") * 128 >= 64 * 4  # each thread a share of the rows' lines
    assert not re.search(r"\b(ld|st|cp\.async)\.global", before)
    assert "prefetch" not in after and "cp.async" in after and "st.global" in after
