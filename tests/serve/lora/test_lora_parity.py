"""Greedy tokens and logits of the engine with LoRA adapters against Hugging Face transformers + PEFT
(`adapter_names=`), fp32 on the tiny zoo: one batch mixing adapters of different ranks, targets
and scalings (rsLoRA, rank_pattern), requests without adapter, images, a video (Qwen) and
different prompt lengths; the same prompt under two adapters; arriving together or staggered,
with adapters swapped in and out of too few slots, and under forced preemption.
Logits agree within serve_cases.LOGITS_ATOL (1e-4)."""

from __future__ import annotations

import pytest
import torch
from adapter_cases import build_adapters, peft_generate, peft_model
from adapter_cases import one_thread  # noqa: F401 (autouse: one intra-op thread here)
from serve_cases import assert_matches_hf, case_specs, make_request

MAX_NEW = 4

from serve import Engine, EngineConfig, Request, SamplingParams

ARCHS = {"qwen2_vl_tiny": "qwen2_vl", "qwen2_5_vl_tiny": "qwen2_5_vl", "llava_1_5_tiny": "llava"}
_REFERENCES: dict[str, list] = {}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("parity_adapters")
    return {name: build_adapters(path, root / name) for name, path in tiny_zoo.items()}


def _cases(arch: str) -> list[tuple[dict, str | None]]:
    specs = case_specs(arch)
    cases = [(specs[0], "qv8"), (specs[1], None), (specs[2], "all16"), (specs[1], "mix")]  # spec 1 twice
    cases.append((specs[3] if arch != "llava" else specs[2], "qv8"))  # a video clip (Qwen); "qv8" again
    return cases


def _requests(arch: str):
    out = []
    for spec, adapter in _cases(arch):
        request = make_request(spec, MAX_NEW)
        request.adapter = adapter
        out.append(request)
    return out


def _references(name, tiny_zoo, adapter_dirs):
    if name not in _REFERENCES:
        adapters = tuple((k, str(p)) for k, p in adapter_dirs[name].items())
        model, processor = peft_model(str(tiny_zoo[name]), adapters)
        _REFERENCES[name] = [peft_generate(model, processor, spec, adapter, MAX_NEW)
                             for spec, adapter in _cases(ARCHS[name])]
    return _REFERENCES[name]


def _engine(name, tiny_zoo, adapter_dirs, **config) -> Engine:
    engine = Engine(tiny_zoo[name], EngineConfig(device="cpu", **config))
    for adapter, path in adapter_dirs[name].items():
        engine.load_adapter(adapter, path)
    return engine


@pytest.mark.parametrize("name", list(ARCHS))
def test_a_mixed_adapter_batch_arriving_together_matches_peft(name, tiny_zoo, adapter_dirs):
    engine = _engine(name, tiny_zoo, adapter_dirs, num_kv_blocks=64, adapter_slots=4)
    outputs = engine.generate(_requests(ARCHS[name]))
    references = _references(name, tiny_zoo, adapter_dirs)
    assert_matches_hf(outputs, references)
    # the same prompt with no adapter and with "mix" gives different answers: the adapters act
    assert outputs[1].logits[0].sub(outputs[3].logits[0]).abs().max() > 1e-2
    stats = engine.stats()
    assert stats.blocks_in_use == 0 and stats.adapter_swaps == 3 and stats.adapter_slot_evictions == 0


@pytest.mark.parametrize("name", list(ARCHS))
def test_staggered_arrivals_with_adapters_swapped_through_one_slot_match_peft(name, tiny_zoo, adapter_dirs):
    # one slot for three adapters: requests wait for their adapter's swap while the others run;
    # a 24-token budget splits every prompt over several steps
    engine = _engine(name, tiny_zoo, adapter_dirs, num_kv_blocks=64, kv_block_size=8, max_tokens_per_step=24,
                     adapter_slots=1)
    ids, final = [], {}
    for request in _requests(ARCHS[name]):
        ids.append(engine.add_request(request))
        for _ in range(2):
            final.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert_matches_hf([final[i] for i in ids], _references(name, tiny_zoo, adapter_dirs))
    stats = engine.stats()
    assert stats.adapter_slot_evictions >= 2 and stats.adapter_swaps >= 4  # "qv8" came back after others
    assert stats.blocks_in_use == 0 and stats.adapters_resident == 1


@pytest.mark.parametrize("name", list(ARCHS))
def test_forced_preemption_with_adapters_keeps_the_outputs(name, tiny_zoo, adapter_dirs):
    arch = ARCHS[name]
    probe = Engine(tiny_zoo[name], EngineConfig(device="cpu", num_kv_blocks=8, adapter_slots=0))
    lengths = [len(probe.processor.process(s["prompt"], None, s.get("images", []), s.get("video")).token_ids)
               for s, _ in _cases(arch)]
    blocks = max(sum(-(-n // 4) for n in lengths) + 1, -(-(max(lengths) + 6) // 4))
    engine = _engine(name, tiny_zoo, adapter_dirs, num_kv_blocks=blocks, kv_block_size=4,
                     enable_prefix_cache=False, adapter_slots=3)
    outputs = engine.generate(_requests(arch))
    stats = engine.stats()
    assert stats.num_preemptions > 0 and any(o.metrics.num_preemptions for o in outputs)
    assert_matches_hf(outputs, _references(name, tiny_zoo, adapter_dirs))
    assert stats.blocks_in_use == 0


def test_the_triton_path_computes_what_the_torch_path_computes(tiny_zoo, adapter_dirs):
    if torch.cuda.is_available():  # a CPU engine's Triton kernels run only under the interpreter (CPU hosts)
        pytest.skip("CPU hosts only; on a GPU test_lora_graph_decode_matches_eager_decode_on_gpu runs the kernels")
    # bf16 so the ATMM kernels (Triton interpreter on CPU) run, against the same engine on the PyTorch op;
    # short token prompts keep the interpreter's work small
    name = "qwen2_vl_tiny"
    outs = {}
    for backend in ("triton", "torch"):
        # the triton engine also asks for the shrink beside the base matmul: on CPU that is the plain order
        engine = _engine(name, tiny_zoo, adapter_dirs, num_kv_blocks=64, adapter_slots=3, dtype="bfloat16",
                         max_lora_rank=16, lora_backend=backend, lora_overlap_shrink=backend == "triton")
        assert {layer.overlap_shrink for layer in engine.lora.layers} == {backend == "triton"}
        requests = [Request(prompt_token_ids=[5 + i, 40, 41, 300 + 7 * i, 42, 43 + i], adapter=adapter,
                            sampling=SamplingParams(max_tokens=2, keep_logits=True))
                    for i, adapter in enumerate(("mix", None, "all16"))]
        outs[backend] = engine.generate(requests)
    for triton_out, torch_out in zip(outs["triton"], outs["torch"]):
        assert triton_out.token_ids == torch_out.token_ids
        for a, b in zip(triton_out.logits, torch_out.logits):
            assert (a - b).abs().max() < 0.05 * b.abs().max()  # bf16 roundings in different orders
    assert (outs["torch"][0].logits[0] - outs["torch"][1].logits[0]).abs().max() > 0.05  # the adapter acts


@pytest.mark.gpu
def test_lora_graph_decode_matches_eager_decode_on_gpu(tiny_zoo, adapter_dirs):
    # bf16: the ATMM kernels run, in CUDA graphs over the fixed metadata buffers or eagerly
    name, arch = "qwen2_vl_tiny", "qwen2_vl"
    outs = {}
    for graphs in (True, False):
        engine = Engine(tiny_zoo[name], EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=256,
                                                     cuda_graphs=graphs, graph_batch_sizes=(1, 2, 4, 8),
                                                     adapter_slots=2))
        for adapter, path in adapter_dirs[name].items():
            engine.load_adapter(adapter, path)
        requests = _requests(arch)
        for r in requests:
            r.sampling = SamplingParams(max_tokens=8, ignore_eos=True, keep_logits=True)
        outs[graphs] = engine.generate(requests)  # two slots for three adapters: swaps on the side stream
        stats = engine.stats()
        assert (stats.graph_steps > 0) == graphs and stats.adapter_slot_evictions > 0 and stats.blocks_in_use == 0
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=2e-2, rtol=2e-2)


def _gpu_graph_run(tiny_zoo, adapter_dirs, **config):
    """(engine, outputs) of the tiny Qwen2-VL with every test adapter, decoding from CUDA graphs."""
    name, arch = "qwen2_vl_tiny", "qwen2_vl"
    engine = Engine(tiny_zoo[name], EngineConfig(device="cuda", dtype="bfloat16", num_kv_blocks=256,
                                                 graph_batch_sizes=(1, 2, 4, 8), adapter_slots=3, **config))
    for adapter, path in adapter_dirs[name].items():
        engine.load_adapter(adapter, path)
    requests = _requests(arch)
    for r in requests:
        r.sampling = SamplingParams(max_tokens=8, ignore_eos=True, keep_logits=True)
    outputs = engine.generate(requests)
    assert engine.stats().graph_steps > 0
    return engine, outputs


@pytest.mark.gpu
def test_shrink_beside_the_base_matmul_decodes_the_same_tokens_on_gpu(tiny_zoo, adapter_dirs):
    """lora_overlap_shrink: each shrink on a side stream while the base matmul runs, in the decode
    graphs and in eager prefill: the same tokens and logits as the plain order."""
    outs = {overlap: _gpu_graph_run(tiny_zoo, adapter_dirs, lora_overlap_shrink=overlap)[1]
            for overlap in (True, False)}
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits)), "the same kernels on the same inputs"


@pytest.mark.gpu
def test_the_handoff_kernel_in_the_decode_graphs_decodes_the_same_tokens_on_gpu(tiny_zoo, adapter_dirs, monkeypatch):
    """Where a table sends decode batches to the one-launch handoff kernel: graphs captured with
    it (its counters and workspace are per stream, made in the warm-up on the capture stream)
    decode the same tokens as the two launches, and it did run, in the graphs and eagerly."""
    import vlora_kernels.lora
    from vlora_kernels.tiling import FUSED_MAX_RANK, HANDOFF_MAX_TOKENS, TileConfig

    outs = {}
    for handoff in (True, False):
        calls = []
        if handoff:  # every plain decode batch to the handoff kernel, as a table that measured it faster would
            real = vlora_kernels.lora.handoff_add_lora

            def pick(x, lora_a, meta, slices, table=None):
                if meta.mix_slot is not None or meta.num_segments == 0 or lora_a.shape[2] > FUSED_MAX_RANK or \
                        meta.num_tokens > HANDOFF_MAX_TOKENS:
                    return None
                return "handoff", TileConfig(16, 32, 32, split_k=2, col_tiles=2)

            monkeypatch.setattr(vlora_kernels.lora, "one_launch_for", pick)
            monkeypatch.setattr(vlora_kernels.lora, "handoff_add_lora", lambda *a: calls.append(1) or real(*a))
        _, outs[handoff] = _gpu_graph_run(tiny_zoo, adapter_dirs)
        assert (len(calls) > 0) == handoff
        monkeypatch.undo()
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_decode_graphs_for_narrow_adapter_mixes_decode_the_same_tokens_on_gpu(tiny_zoo, adapter_dirs):
    """lora_graph_segments / lora_graph_seg_lens: each bucket also holds LoRA graphs for steps of
    at most 1 or 2 adapters with at most 1 or 2 tokens each, replayed where they hold the step:
    the same tokens as the any-mix graphs (logits to rounding: another tiling sums v in another
    order)."""
    outs = {}
    for bounds in ((1, 2), ()):
        engine, outs[bounds] = _gpu_graph_run(tiny_zoo, adapter_dirs, lora_graph_segments=bounds,
                                              lora_graph_seg_lens=bounds)
        graphs = engine.runner.graphs
        assert sorted(graphs.lora_graphs) == sorted((bs, *v) for bs in (1, 2, 4, 8) for v in graphs.variants(bs))
        # bounds (1, 2) with 3 slots: buckets 1, 2, 4, 8 hold 1, 2x2, 3x3 and 3x3 LoRA graphs
        assert len(graphs.lora_graphs) == (23 if bounds else 4)
    for a, b in zip(outs[(1, 2)], outs[()]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_adapter_bench_smoke_on_gpu(tmp_path):
    from bench.adapters import AdapterBenchJob, run_adapter_bench

    job = AdapterBenchJob(model="qwen2_vl_tiny", batch_size=4, prompt_tokens=16, image_size=112, output_tokens=4,
                          mixes=("none", "one", "distinct3", "zipf3"), hf_mix="zipf3", swap_repeats=3,
                          out_dir=str(tmp_path))
    rows, meta = run_adapter_bench(job)
    assert len(rows) == 8 and all(r["decode_step_ms"] > 0 and r["decode_floor_ms"] > 0 for r in rows)
    from zoo import get_spec

    layers = get_spec("qwen2_vl_tiny").text.num_layers
    # r16_qkvo adapts q|k|v and o, r64_all also gate|up and down: one LoRA op each per layer
    assert [r["lora_ops"] for r in rows] == [2 * layers] * 4 + [4 * layers] * 4
    assert meta["hf"] and meta["head"] and [r["adapter"] for r in meta["swap"]] == ["r64_qkvo", "r64_all"]
    assert list(tmp_path.glob("*/adapters.csv")) and list(tmp_path.glob("*/adapters.json"))
