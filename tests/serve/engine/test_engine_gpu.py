"""GPU only: CUDA-graph decode against eager decode, Triton attention in the engine against
transformers, cache sizing from the memory budget, and a smoke run of the engine benchmark."""

from __future__ import annotations

import pytest
import torch
from serve_cases import case_specs, hf_inputs, make_request

from serve import Engine, EngineConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def free_gpu():
    """An engine sized from the memory budget takes most of the GPU: the previous test's must be gone."""
    yield
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def test_graph_decode_matches_eager_decode(tiny_zoo):
    specs = case_specs("qwen2_vl")
    outs = {}
    for graphs in (True, False):
        engine = Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(device="cuda", num_kv_blocks=256, cuda_graphs=graphs,
                                                                graph_batch_sizes=(1, 2, 4)))
        outs[graphs] = engine.generate([make_request(s, max_new=8, ignore_eos=True) for s in specs])
        assert (engine.stats().graph_steps > 0) == graphs
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-4, rtol=1e-4)


def test_released_graphs_leave_an_engine_that_decodes_eagerly(tiny_zoo):
    """release_graphs (what a tensor-parallel rank does before its group ends) frees every graph;
    later steps run eagerly with the same tokens."""
    specs = case_specs("qwen2_vl")
    engine = Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(device="cuda", num_kv_blocks=256, graph_batch_sizes=(1, 2, 4)))
    before = engine.generate([make_request(s, max_new=8, ignore_eos=True) for s in specs])
    graph_steps = engine.stats().graph_steps
    assert graph_steps > 0
    engine.release_graphs()
    after = engine.generate([make_request(s, max_new=8, ignore_eos=True) for s in specs])
    assert engine.stats().graph_steps == graph_steps  # none replayed after the release
    assert [o.token_ids for o in after] == [o.token_ids for o in before]


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "qwen2_5_vl_tiny", "llava_1_5_tiny"])
def test_gpu_engine_matches_transformers(name, tiny_zoo):
    from zoo import load_pretrained

    hf, processor = load_pretrained(tiny_zoo[name], device="cuda")
    engine = Engine(tiny_zoo[name], EngineConfig(device="cuda", max_tokens_per_step=48))  # cache from the budget
    assert engine.runner.kv_cache.num_blocks > 100
    specs = case_specs("llava" if name.startswith("llava") else "qwen")
    outs = engine.generate([make_request(s, max_new=6) for s in specs])
    for spec, out in zip(specs, outs):
        inputs = hf_inputs(processor, spec).to("cuda")
        with torch.no_grad():
            ref = hf.generate(**inputs, max_new_tokens=6, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
        assert out.token_ids == ref.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        want = torch.stack([step[0].float().cpu() for step in ref.logits])[:len(out.token_ids)]
        # fp32 tl.dot runs in TF32 on the GPU: a looser bound than the CPU parity tests
        torch.testing.assert_close(torch.stack(out.logits), want, atol=5e-3, rtol=5e-3)


def test_engine_bench_smoke(tmp_path):
    from bench.engine import EngineBenchJob, run_engine_bench

    job = EngineBenchJob(model="qwen2_vl_tiny", batch_sizes=(1, 3), prompt_tokens=16, image_size=112,
                         output_tokens=4, dtype="float32", out_dir=str(tmp_path))
    rows, meta = run_engine_bench(job)
    assert [r["batch"] for r in rows] == [1, 3] and all(r["decode_step_ms"] > 0 for r in rows)
    assert meta["graph_steps"] > 0
    assert list(tmp_path.glob("*/engine.csv")) and list(tmp_path.glob("*/engine.json"))
