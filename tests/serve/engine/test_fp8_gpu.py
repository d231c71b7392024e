"""GPU only (compute capability >= 8.9): the FP8 GEMM path (Triton per-token quantization + rowwise
torch._scaled_mm) against the dequantized fp32 reference at 7B projection shapes, and the engine with
quantization=fp8 (CUDA graphs) against bf16: tokens mostly agree, heads agree, merge / unmerge
restores the exact bytes, graphs replay the same tokens as eager steps, and the bench runs."""

from __future__ import annotations

import pytest
import torch
from adapter_cases import make_classifier_adapter
from serve_cases import case_specs, make_request

from vlora_kernels.fp8 import dequantize, fp8_linear, quantize_rows_ref, quantize_rows_triton, quantize_weight, rows_wanted
from serve import Engine, EngineConfig
from serve.orchestrator import Mode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 tensor cores (compute capability >= 8.9)")]


@pytest.fixture(autouse=True)
def free_gpu():
    yield
    import gc

    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("k,n", [(3584, 4608), (3584, 37888), (18944, 3584)])  # qkv, gate_up, down of the 7B
def test_fp8_gemm_matches_dequantized_reference(m, k, n):
    g = torch.Generator(device="cuda").manual_seed(m + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    x[0, 5] = 300.0  # an outlier token feature
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    q_w, s_w = quantize_weight(w)
    q_x, s_x = quantize_rows_triton(x)
    q_ref, s_ref = quantize_rows_ref(x)
    assert torch.equal(s_x, s_ref) and torch.equal(q_x.view(torch.uint8), q_ref.view(torch.uint8))
    y = fp8_linear(x, q_w, s_w)
    assert y.dtype == torch.bfloat16
    # fp32 of exactly what was multiplied: x's FP8 rows, or at decode sizes x itself (the weight-only GEMM)
    ref = (dequantize(q_x, s_x.squeeze(1)) if rows_wanted(x) else x.float()) @ dequantize(q_w, s_w).T
    torch.testing.assert_close(y.float(), ref, atol=2e-2 * ref.abs().max().item() / 8, rtol=1e-2)


@pytest.fixture(scope="module")
def adapter(tiny_zoo, tmp_path_factory):
    return make_classifier_adapter(tiny_zoo["qwen2_vl_tiny"], tmp_path_factory.mktemp("fp8_gpu") / "cls")


def _engine(ckpt, adapter, quantization: str, graphs: bool = True) -> Engine:
    engine = Engine(ckpt, EngineConfig(device="cuda", dtype="bfloat16", quantization=quantization, num_kv_blocks=256,
                                       cuda_graphs=graphs, graph_batch_sizes=(1, 2, 4, 8), enable_prefix_cache=False,
                                       adapter_slots=2, max_lora_rank=8))
    engine.load_adapter("cls", adapter)
    return engine


def _requests():
    specs = case_specs("qwen2_vl")
    gen, heads = [], []
    for i, spec in enumerate(specs):
        r = make_request(spec, 8, ignore_eos=True)
        r.adapter = "cls" if i % 2 else None
        gen.append(r)
        h = make_request(spec)
        h.adapter, h.output_mode = "cls", "head"
        heads.append(h)
    return gen + heads


def test_fp8_engine_close_to_bf16_with_graphs(tiny_zoo, adapter):
    ckpt = tiny_zoo["qwen2_vl_tiny"]
    ref = _engine(ckpt, adapter, "none").generate(_requests())
    engine = _engine(ckpt, adapter, "fp8")
    got = engine.generate(_requests())
    assert engine.stats().graph_steps > 0
    n = len(case_specs("qwen2_vl"))
    same = sum(a == b for r, o in zip(ref[:n], got[:n]) for a, b in zip(r.token_ids, o.token_ids))
    assert same >= 0.75 * 8 * n
    for r, o in zip(ref[:n], got[:n]):
        a, b = r.logits[0].float(), o.logits[0].float()
        assert (a - b).abs().max() < 0.1 * a.abs().max()
    for r, o in zip(ref[n:], got[n:]):
        assert o.head.label == r.head.label and abs(o.head.confidence - r.head.confidence) < 0.03
    # graphs pad the batch to their bucket, and the GEMM may pick another algorithm for another row
    # count: the same tokens up to a near tie, the same logits up to the summation order
    eager = _engine(ckpt, adapter, "fp8", graphs=False).generate(_requests())
    same = sum(a == b for e, o in zip(eager[:n], got[:n]) for a, b in zip(e.token_ids, o.token_ids))
    assert same >= 0.9 * 8 * n
    for e, o in zip(eager[:n], got[:n]):
        torch.testing.assert_close(o.logits[0].float(), e.logits[0].float(), atol=2e-2, rtol=2e-2)


def test_fp8_merge_unmerge_restores_exact_bytes_on_gpu(tiny_zoo, adapter):
    engine = _engine(tiny_zoo["qwen2_vl_tiny"], adapter, "fp8")
    before = [(m.base.weight.view(torch.uint8).clone(), m.base.weight_scale.clone())
              for _, _, m in engine.model.language_model.projections()]
    unmerged = engine.generate(_requests()[1:2])
    engine.set_mode(Mode.merge("cls"))
    merged = engine.generate(_requests()[1:2])
    engine.set_mode(Mode.unmerge())
    after = [(m.base.weight.view(torch.uint8), m.base.weight_scale)
             for _, _, m in engine.model.language_model.projections()]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, after))
    a, b = unmerged[0].logits[0].float(), merged[0].logits[0].float()
    assert (a - b).abs().max() < 0.15 * a.abs().max()


def test_fp8_bench_runs_on_gpu_at_the_tiny_shape(vlora_home, tmp_path):
    from bench.fp8 import Fp8BenchJob, run_fp8_bench

    rows, _ = run_fp8_bench(Fp8BenchJob(model="qwen2_vl_tiny", device="cuda", prompts=3, prompt_tokens=16,
                                        image_size=56, output_tokens=6, batch_sizes=(1, 4), decode_tokens=3,
                                        switch_repeats=2, out_dir=str(tmp_path)))
    steps = [r for r in rows if r["section"] == "decode"]
    assert steps and all(r["decode_step_ms"] > 0 for r in steps)
    assert next(r for r in rows if r["section"] == "switch" and r["precision"] == "fp8")["restore_exact"] is True
