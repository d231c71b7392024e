"""The watch on Triton's compiler (serve/engine/compile_watch.py): variants compiled before the warm-up
ends are start-up, those after it are counted and each kernel's first is logged with its specialisation.
The hook is driven as Triton calls it (keyword arguments); on the CPU Triton's interpreter compiles nothing."""

from __future__ import annotations

import logging

import pytest

from serve.engine.compile_watch import CompileWatch


class _Fn:
    def __init__(self, name):
        self.name = name


def test_compiles_after_ready_are_counted_and_named_once(caplog):
    watch = CompileWatch()
    watch.compiled("atmm_shrink", "atmm_shrink[num_warps=4](x: *bf16, n: i32)")
    assert watch.stats()["before_ready"] == 1 and watch.stats()["after_ready"] == 0
    watch.mark_ready()
    with caplog.at_level(logging.WARNING, logger="vlora.serve.engine"):
        watch.compiled("atmm_shrink", "atmm_shrink[num_warps=4](x: *bf16, n: constexpr=1)")
        watch.compiled("atmm_shrink", "atmm_shrink[num_warps=8](x: *bf16, n: i32)")
        watch.compiled("paged_attention", "paged_attention(q: *bf16)")
    stats = watch.stats()
    assert stats["after_ready"] == 3 and "n: constexpr=1" in stats["late"][0]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and "atmm_shrink" in warned[0] and "while serving" in warned[0]


def test_the_hook_chains_onto_tritons_own():
    knobs = pytest.importorskip("triton").knobs
    runtime = knobs.runtime
    saved, calls = runtime.jit_post_compile_hook, []
    runtime.jit_post_compile_hook = lambda **kw: calls.append(kw["repr"])
    try:
        watch = CompileWatch()
        assert watch.install() and watch.install()  # once
        watch.mark_ready()
        runtime.jit_post_compile_hook(key=None, repr="k(x: *fp32)", fn=_Fn("k"), compile={},
                                      is_manual_warmup=False, already_compiled=False)
        assert calls == ["k(x: *fp32)"] and watch.stats()["after_ready"] == 1
    finally:
        runtime.jit_post_compile_hook = saved


def test_a_variant_is_named_by_its_constants_and_specialised_arguments():
    """As Triton 3.6+ passes them: the signature in parameter order, constants and attributes keyed by
    (index,); the late variants of a cold start must be told apart by these, not by Triton's repr."""
    from serve.engine.compile_watch import describe

    compile = {"signature": {"x_ptr": "*bf16", "n_segments": "i32", "K": "i32", "BLOCK_M": "constexpr"},
               "constants": {(1,): 1, (3,): 64}, "configs": [{(0,): [["tt.divisibility", 16]],
                                                             (2,): [("tt.divisibility", 16)]}],
               "num_warps": 4, "num_stages": 3}
    assert describe("_shrink_kernel", compile) == \
        "_shrink_kernel[num_warps=4, num_stages=3](n_segments=1, BLOCK_M=64, x_ptr%16, K%16)"
    assert describe("k", {"signature": {}}) is None  # laid out otherwise: the caller keeps Triton's repr
