"""Head mode: requests answered by their adapter's task head after one prefill, mixed in one batch
with generating requests, equal to the head applied to the final hidden states of Hugging Face
transformers + PEFT (`adapter_names=`); head choice by domain or task, and its errors."""

from __future__ import annotations

import pytest
import torch
from adapter_cases import make_adapter, make_head, peft_generate, peft_model, write_meta
from adapter_cases import one_thread  # noqa: F401 (autouse: one intra-op thread here)
from serve_cases import case_specs, hf_inputs, make_request

from heads import load_head, save_head
from train.token_grid import visual_token_xy
from serve import Engine, EngineConfig
from serve.lora import select_head

ARCHS = {"qwen2_5_vl_tiny": "qwen2_5_vl", "llava_1_5_tiny": "llava"}
# domain -> (task named in meta.json, head type, pooling)
DOMAINS = {"colour": ("color", "classify", "attention"), "vehicles": ("count", "count", "mean"),
           "cars": ("detect", "detect", "last"), "bus": ("exists", "binary", "attention"),
           "trucks": ("locate", "detect", "dense")}


@pytest.fixture(scope="module")
def head_adapters(tiny_zoo, tmp_path_factory):
    """Per model: "multi" (four heads under heads/<domain>/ with meta.json) and "single" (one root head)."""
    from zoo import load_pretrained

    out = {}
    for name in ARCHS:
        root = tmp_path_factory.mktemp(f"heads_{name}")
        model = load_pretrained(tiny_zoo[name])[0]
        hidden = model.config.get_text_config().hidden_size
        multi = make_adapter(model, root / "multi", ["q_proj", "v_proj", "down_proj"], 8, 16, seed=5)
        for i, (domain, (_, type_, pooling)) in enumerate(DOMAINS.items()):
            low = {"score_threshold": 0.3} if pooling == "dense" else {}
            make_head(multi / "heads" / domain, type_, hidden, seed=i, pooling=pooling, **low)
            if pooling == "dense":  # a random dense head that reports boxes: scores around 0.5, not the prior
                head = load_head(multi / "heads" / domain)
                with torch.no_grad():
                    head.proj.weight[0] *= 0.05
                    head.proj.bias[0] = 0.0
                save_head(head, multi / "heads" / domain)
        write_meta(multi, {d: task for d, (task, _, _) in DOMAINS.items()})
        single = make_adapter(model, root / "single", ["o_proj", "gate_proj"], 4, 8, seed=6)
        make_head(single, "binary", hidden, seed=9, pooling="mean")
        bare = make_adapter(model, root / "bare", ["v_proj"], 4, 8, seed=7)
        out[name] = {"multi": multi, "single": single, "bare": bare}
    return out


def _peft_head(model, processor, spec, adapter, head):
    inputs = hf_inputs(processor, spec)
    with torch.no_grad():
        out = model(**inputs, adapter_names=[adapter], output_hidden_states=True)
    hidden = out.hidden_states[-1]  # [1, P, D]: after the final norm (checked: it gives the logits)
    assert torch.allclose(model.get_output_embeddings()(hidden), out.logits, atol=1e-5)
    xy = None
    if head.config.pooling == "dense":  # cell centres from transformers' processor output, as training has them
        ids = inputs["input_ids"][0]
        cfg = model.config
        tokens = [getattr(cfg, k, None) for k in ("image_token_id", "image_token_index", "video_token_id")]
        mask = torch.isin(ids, torch.tensor([t for t in tokens if t is not None]))
        sizes = [(im.shape[1], im.shape[0]) for im in spec.get("images", [])] or [spec["video"][0].shape[1::-1]]
        xy = visual_token_xy(model, processor, inputs, mask, sizes)[None]
    return head.predict(hidden, None, xy)[0]


def _assert_same(got, want):
    assert got.type == want.type and got.label == want.label and got.count == want.count
    assert got.answer == want.answer
    assert abs(got.confidence - want.confidence) < 1e-4
    if want.boxes is not None:
        assert torch.allclose(torch.tensor(got.boxes), torch.tensor(want.boxes), atol=1e-4)
        assert torch.allclose(torch.tensor(got.scores), torch.tensor(want.scores), atol=1e-4)


def _head_request(spec, adapter, task=None):
    request = make_request(spec)
    request.adapter, request.output_mode, request.task = adapter, "head", task
    return request


@pytest.mark.parametrize("name", list(ARCHS))
@pytest.mark.parametrize("budget", [4096, 24], ids=["whole", "chunked"])
def test_head_requests_mixed_with_generation_match_heads_on_peft_hidden_states(name, budget, tiny_zoo,
                                                                              head_adapters):
    specs = case_specs(ARCHS[name])
    dirs = head_adapters[name]
    engine = Engine(tiny_zoo[name], EngineConfig(device="cpu", num_kv_blocks=96, kv_block_size=8,
                                                 max_tokens_per_step=budget, adapter_slots=3))
    for adapter, path in dirs.items():
        engine.load_adapter(adapter, path)
    cases = [(specs[0], "multi", "colour"), (specs[1], "multi", "count"), (specs[2], "multi", "cars"),
             (specs[0], "multi", "exists"), (specs[-1], "single", None), (specs[2], "multi", "locate")]
    if name != "llava_1_5_tiny":
        cases.append((specs[3], "multi", "trucks"))  # a clip's tokens, frame group by frame group
    generating = make_request(specs[1])
    generating.adapter = "multi"
    outputs = engine.generate([_head_request(s, a, t) for s, a, t in cases] + [generating])
    model, processor = peft_model(str(tiny_zoo[name]), tuple((k, str(p)) for k, p in dirs.items()))
    for out, (spec, adapter, task) in zip(outputs, cases):
        domain = {"count": "vehicles", "exists": "bus", "locate": "trucks"}.get(task, task)
        head = load_head(dirs[adapter] / "heads" / domain) if domain else load_head(dirs[adapter])
        assert out.finish_reason == "head" and out.token_ids == [] and out.finished
        _assert_same(out.head, _peft_head(model, processor, spec, adapter, head))
        assert out.head.to_dict()["type"] == head.config.type
    tokens, _ = peft_generate(model, processor, specs[1], "multi")
    assert outputs[-1].token_ids == tokens and outputs[-1].finish_reason in ("stop", "length")
    stats = engine.stats()
    assert stats.blocks_in_use == 0 and stats.waiting == stats.running == 0


def test_a_head_request_survives_preemption(tiny_zoo, head_adapters):
    name = "qwen2_5_vl_tiny"
    spec = case_specs("qwen2_5_vl")[2]
    dirs = head_adapters[name]
    probe = Engine(tiny_zoo[name], EngineConfig(device="cpu", num_kv_blocks=8, adapter_slots=0))
    n = len(probe.processor.process(spec["prompt"], None, spec["images"], None).token_ids)
    # the generating request fills the cache while the head request's prompt is in its chunks
    engine = Engine(tiny_zoo[name], EngineConfig(device="cpu", num_kv_blocks=-(-n // 4) + 3, kv_block_size=4,
                                                 max_tokens_per_step=16, adapter_slots=1,
                                                 enable_prefix_cache=False))
    engine.load_adapter("multi", dirs["multi"])
    first = make_request(case_specs("qwen2_5_vl")[1], max_new=40)
    first.adapter = "multi"
    outputs = engine.generate([first, _head_request(spec, "multi", "colour")])
    model, processor = peft_model(str(tiny_zoo[name]), tuple((k, str(p)) for k, p in dirs.items()))
    want = _peft_head(model, processor, spec, "multi", load_head(dirs["multi"] / "heads" / "colour"))
    assert outputs[1].metrics.num_preemptions > 0  # its prefill started over
    _assert_same(outputs[1].head, want)


def test_which_head_answers(tiny_zoo, head_adapters):
    name = "llava_1_5_tiny"
    engine = Engine(tiny_zoo[name], EngineConfig(device="cpu", num_kv_blocks=32, adapter_slots=2))
    for adapter, path in head_adapters[name].items():
        engine.load_adapter(adapter, path)
    info = {a["name"]: a for a in engine.list_adapters()}
    assert info["multi"]["heads"] == {d: task for d, (task, _, _) in DOMAINS.items()}
    assert info["multi"]["tasks"] == sorted(task for task, _, _ in DOMAINS.values())
    assert info["single"]["heads"] == {"default": "binary"} and info["bare"]["heads"] == {}
    spec = case_specs("llava")[1]
    with pytest.raises(ValueError, match="several heads: bus \\(exists\\), cars \\(detect\\)"):
        engine.add_request(_head_request(spec, "multi"))
    with pytest.raises(ValueError, match="has no head for task 'plates'"):
        engine.add_request(_head_request(spec, "multi", "plates"))
    with pytest.raises(ValueError, match="output_mode 'head' needs an adapter"):
        engine.add_request(_head_request(spec, None))
    with pytest.raises(ValueError, match="adapter 'bare' has none"):
        engine.add_request(_head_request(spec, "bare"))
    with pytest.raises(ValueError, match="reads boxes off a picture's tokens, but the request has no image"):
        engine.add_request(_head_request(spec, "multi", "locate"))  # spec: text only
    heads = engine.lora.records["multi"].heads
    twice = {"domains": {"colour": {"task": "count"}, "vehicles": {"task": "count"}}}
    with pytest.raises(ValueError, match="'count' of adapter 'x' is ambiguous"):
        select_head("x", {d: heads[d] for d in ("colour", "vehicles")}, twice, "count")
    assert engine.stats().in_flight == 0  # refused requests left nothing behind
    by_task, by_domain = engine.generate([_head_request(spec, "multi", "count"),
                                          _head_request(spec, "multi", "vehicles")])
    assert by_task.head.type == "count"
    _assert_same(by_task.head, by_domain.head)
    assert engine.generate(_head_request(spec, "single")).head.answer in ("yes", "no")


def test_heads_of_a_step_run_batched_and_answer_as_one_by_one():
    from heads import HeadConfig, build_head
    from serve.lora.heads import run_heads

    torch.manual_seed(0)
    from heads import grid_xy, prompt_token_xy

    torch.manual_seed(0)
    heads = [build_head(HeadConfig(type=t, hidden_size=16, pooling=p, **kw)).eval()
             for t, p, kw in (("classify", "attention", {"labels": ["a", "b", "c"]}), ("count", "mean", {"max_count": 4}),
                              ("detect", "last", {"labels": ["car"], "max_boxes": 3}), ("binary", "attention", {}),
                              ("detect", "dense", {"score_threshold": 0.3}))]
    with torch.no_grad():
        heads[4].proj.weight.normal_(0, 1.0)  # objectness and boxes that differ token to token
    lengths = [5, 9, 1, 7, 3, 12, 2, 8, 9, 7]  # heads[i % 5]: the dense head gets prompts 4 and 9 (3 and 7 rows)
    # every prompt of 3 rows or more holds a picture of 2 x (rows - 1) // 2 tokens after one text token
    jobs = [(heads[i % 5], torch.randn(n, 16), prompt_token_xy(n, [(1, grid_xy(2, (n - 1) // 2))]) if n > 2 else None)
            for i, n in enumerate(lengths)]
    batched = run_heads(jobs)
    for (head, rows, xy), got in zip(jobs, batched):
        want = head.predict(rows[None], None, None if xy is None else xy[None])[0]
        g, w = got.to_dict(), want.to_dict()
        assert g.keys() == w.keys()
        for key in g:
            assert g[key] == (pytest.approx(w[key]) if isinstance(w[key], float) else w[key]), key
