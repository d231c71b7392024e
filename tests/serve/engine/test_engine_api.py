"""The Engine API: streaming, abort, stop and length limits, seeded sampling, stats, input errors,
and the Triton attention backend (interpreter) inside the engine."""

from __future__ import annotations

import pytest
import torch
from serve_cases import case_specs, image, make_request

from serve import Engine, EngineConfig, Request, SamplingParams
from serve.engine.request import STEP_PHASES, phases_ms

NAME = "qwen2_vl_tiny"


@pytest.fixture(scope="module")
def engine(tiny_zoo):
    return Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=128, max_tokens_per_step=64))


def test_streamed_deltas_add_up_to_the_final_output(engine):
    requests = [make_request(s, max_new=5) for s in case_specs("qwen2_vl")[:3]]
    final = {r.request_id: r for r in engine.generate([make_request(s, max_new=5) for s in case_specs("qwen2_vl")[:3]])}
    seen: dict[str, list] = {}
    for out in engine.generate(requests, stream=True):
        tokens, text, done = seen.setdefault(out.request_id, [[], "", False])
        assert not done, "nothing after the final output"
        seen[out.request_id] = [tokens + out.new_token_ids, text + out.new_text, out.finished]
        assert out.token_ids == seen[out.request_id][0]
    assert len(seen) == 3 and all(done for _, _, done in seen.values())
    assert sorted(len(t) for t, _, _ in seen.values()) == sorted(len(o.token_ids) for o in final.values())
    for tokens, text, _ in seen.values():
        assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_abort_frees_blocks_and_leaves_the_others_alone(engine):
    specs = case_specs("qwen2_vl")[:2]
    alone = engine.generate(make_request(specs[1], max_new=6))
    ids = [engine.add_request(make_request(s, max_new=6)) for s in specs]
    engine.step()
    engine.step()
    assert engine.stats().blocks_in_use > 0
    assert engine.abort(ids[0]) and not engine.abort("no-such-request")
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outputs[ids[0]].finish_reason == "abort" and len(outputs[ids[0]].token_ids) == 2
    assert outputs[ids[1]].token_ids == alone.token_ids
    stats = engine.stats()
    assert stats.blocks_in_use == 0 and stats.in_flight == 0 and stats.waiting == stats.running == 0


def test_stop_tokens_max_tokens_and_ignore_eos(engine, tiny_zoo):
    spec = case_specs("qwen2_vl")[1]
    free = engine.generate(make_request(spec, max_new=5, ignore_eos=True))
    assert free.finish_reason == "length" and len(free.token_ids) == 5
    stop_at = free.token_ids[2]
    first = free.token_ids.index(stop_at)
    stopped = engine.generate(make_request(spec, max_new=5, ignore_eos=True, stop_token_ids=(stop_at,)))
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first + 1]
    assert 2 in engine.eos_token_ids  # <|im_end|> from generation_config.json


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    spec = case_specs("qwen2_vl")[0]
    params = dict(temperature=1.5, top_p=0.95, seed=11)
    alone = engine.generate(make_request(spec, max_new=6, ignore_eos=True, **params))
    others = [make_request(s, max_new=6, ignore_eos=True, temperature=1.0) for s in case_specs("qwen2_vl")]
    crowd = engine.generate(others + [make_request(spec, max_new=6, ignore_eos=True, **params)])
    assert crowd[-1].token_ids == alone.token_ids
    other = engine.generate(make_request(spec, max_new=6, ignore_eos=True, temperature=1.5, top_p=0.95, seed=12))
    greedy = engine.generate(make_request(spec, max_new=6, ignore_eos=True))
    assert len({tuple(alone.token_ids), tuple(other.token_ids), tuple(greedy.token_ids)}) > 1


def test_stats_report_queue_blocks_and_step_times(engine):
    before = engine.stats()
    rid = engine.add_request(make_request(case_specs("qwen2_vl")[0], max_new=3))
    queued = engine.stats()
    assert queued.waiting == before.waiting + 1 and queued.in_flight == before.in_flight + 1
    engine.step()
    running = engine.stats()
    assert running.running == 1 and running.blocks_in_use > 0 and running.step_time_last_ms > 0
    assert running.num_steps == before.num_steps + 1
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.request_id == rid and out.metrics.time_to_first_token > 0
    assert engine.stats().blocks_in_use == 0


def test_a_request_counts_the_steps_it_ran_in_and_what_arrived_during_them(engine):
    spec = case_specs("qwen2_vl")[0]
    arrivals = iter([make_request(case_specs("qwen2_vl")[1], max_new=2)])
    engine.during_step = lambda: [engine.add_request(r) for r in arrivals]  # one arrival, mid-step
    engine.encode_ahead = True  # as on a GPU: the step takes arrivals in while the device runs it
    try:
        first = engine.add_request(make_request(spec, max_new=3, ignore_eos=True))
        steps, tokens, final = 0, 0, {}
        while first not in final or not final[first].finished:
            before = engine.num_steps
            final.update({out.request_id: out for out in engine.step()})
            if engine.num_steps > before:  # a step ran (with it: it runs until it finishes)
                steps, tokens = steps + 1, tokens + engine.step_log[-1][1]
        while engine.has_unfinished():
            final.update({out.request_id: out for out in engine.step()})
    finally:
        engine.during_step, engine.encode_ahead = None, False
    m = final[first].metrics
    # its prefill and two decodes: every step it ran in, with every request's tokens in them
    assert m.steps == steps >= 3 and m.step_tokens == tokens >= m.num_prompt_tokens - m.num_cached_tokens + 2
    span = m.finished_time - m.first_scheduled_time
    assert 0 < m.step_s <= span and 0 <= m.plan_s <= span - m.step_s + 1e-6
    assert m.intake_s > 0  # the arrival was taken in during its first step
    assert 0 < m.first_step_s < m.step_s and m.num_prompt_tokens - m.num_cached_tokens <= m.first_step_tokens < tokens
    assert m.graph_steps == 0  # on the CPU every step runs eagerly
    # the runner's phases of its first step (its prefill) and of its last (a decode): each within its step's time
    assert len(m.first_phases_s) == len(m.last_phases_s) == len(STEP_PHASES) and m.first_phases_s != m.last_phases_s
    assert 0 < sum(m.first_phases_s) <= m.first_step_s and 0 < sum(m.last_phases_s) <= m.step_s - m.first_step_s
    first_ms = phases_ms(m.first_phases_s)
    # the stepping thread's CPU time in them: some, never more than the wall (one thread)
    assert 0 < m.first_step_cpu_s <= m.first_step_s + 1e-3 and 0 < m.last_step_cpu_s <= m.last_step_s + 1e-3
    assert sum(m.last_phases_s) <= m.last_step_s
    assert list(first_ms) == list(STEP_PHASES) and first_ms["forward"] > 0
    assert len(final) == 2 and final[first].finish_reason == "length"
    (arrived,) = [out for rid, out in final.items() if rid != first]
    # taken in during the first's prefill, that step ran without it; no loop waited for anyone
    assert m.steps_before == 0 and arrived.metrics.steps_before == 1 and arrived.metrics.lingered_before_s == 0


def test_bad_requests_are_refused_with_what_to_fix(engine):
    spec = case_specs("qwen2_vl")[0]
    with pytest.raises(ValueError, match="adapter 'lora-a' is not loaded"):
        engine.add_request(Request(prompt="x", adapter="lora-a"))
    with pytest.raises(ValueError, match="output_mode 'head' needs an adapter"):
        engine.add_request(Request(prompt="x", output_mode="head"))
    with pytest.raises(ValueError, match="not one of"):
        Request(prompt="x", output_mode="boxes")
    engine.add_request(Request(prompt="x", request_id="dup"))
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(Request(prompt="x", request_id="dup"))
    engine.abort("dup")
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(Request(prompt_token_ids=[5] * 5000))
    with pytest.raises(ValueError, match="prompt_token_ids carry no images"):
        engine.add_request(Request(prompt_token_ids=[5, 6], images=[image(0)]))
    engine.step()
    assert engine.generate(make_request(spec, max_new=2)).finished


def test_triton_attention_in_the_engine_matches_the_torch_path(tiny_zoo):
    # the kernels run in Triton's interpreter here; one short request keeps that fast
    specs = [dict(prompt="Cars?", images=[image(0, 56, 84)]), dict(prompt="Hi")]
    outs = {}
    for backend in ("torch", "triton"):
        engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=32, attention_backend=backend))
        outs[backend] = engine.generate([make_request(s, max_new=3, ignore_eos=True) for s in specs])
    for a, b in zip(outs["torch"], outs["triton"]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-4, rtol=1e-4)


def test_config_from_the_serve_yaml_block():
    from omegaconf import OmegaConf

    block = OmegaConf.to_container(OmegaConf.load("conf/serve.yaml").engine)
    config = EngineConfig.from_dict(block)
    assert config.max_batch_size == block["max_batch_size"] and config.policy == "fcfs"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    assert EngineConfig.from_dict({"lora_graph_seg_lens": [4, 1, 4]}).lora_graph_seg_lens == (1, 4)
    assert EngineConfig.from_dict({"lora_graph_segments": [8, 2]}).lora_graph_segments == (2, 8)
    for name in ("lora_graph_seg_lens", "lora_graph_segments"):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: (0, 2)})


def test_chat_messages_and_raw_prompts_reach_the_same_tokens(engine):
    picture = image(6)
    plain = engine.generate(Request(prompt="How many cars?", images=[picture], sampling=SamplingParams(max_tokens=3)))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many cars?"}]}]
    chat = engine.generate(Request(messages=messages, images=[picture], sampling=SamplingParams(max_tokens=3)))
    raw_text = engine.processor.processor.apply_chat_template(messages, add_generation_prompt=True)
    raw = engine.generate(Request(prompt=raw_text, raw_prompt=True, images=[picture],
                                  sampling=SamplingParams(max_tokens=3)))
    assert plain.token_ids == chat.token_ids == raw.token_ids
    assert plain.metrics.num_prompt_tokens == chat.metrics.num_prompt_tokens == raw.metrics.num_prompt_tokens


def test_a_bad_request_in_a_batch_queues_none_of_it(engine):
    good = make_request(case_specs("qwen2_vl")[1], max_new=2)
    with pytest.raises(ValueError, match="output_mode"):
        engine.generate([good, Request(prompt="x", output_mode="head")])
    stats = engine.stats()
    assert stats.in_flight == 0 and stats.waiting == 0 and not engine.has_unfinished()


def test_a_decode_lane_gives_the_same_tokens_with_decode_only_steps(engine, tiny_zoo):
    """engine.max_prefill_with_decode=0: while anyone decodes, steps carry decode tokens only (after
    decode_burst of them a step takes the waiting prompts); the greedy answers are what they were."""
    requests = lambda: [make_request(s, max_new=6, ignore_eos=True) for s in case_specs("qwen2_vl")[:3]]  # noqa: E731
    plain = {o.request_id: o.token_ids for o in engine.generate(requests())}
    lane = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=128, max_tokens_per_step=64,
                                               max_prefill_with_decode=0, decode_burst=2))
    ids = [lane.add_request(r) for r in requests()]
    outputs, shapes = {}, []
    while lane.has_unfinished():
        outputs.update({o.request_id: o.token_ids for o in lane.step() if o.finished})
        shapes.append(lane.step_log[-1][:3])  # (sequences, tokens, decode-only)
    assert [outputs[i] for i in ids] == list(plain.values())
    # the first prompt's prefill fills a 64-token step, then it decodes: two decode-only steps before the others' turn
    assert shapes[1][2] and shapes[2][2] and not shapes[3][2], shapes


def test_the_next_steps_run_under_the_profiler_and_the_rest_do_not(engine):
    spec = case_specs("qwen2_vl")[0]
    alone = engine.generate(make_request(spec, max_new=6))
    engine.profile_steps(2)
    profiled = engine.generate(make_request(spec, max_new=6))
    assert profiled.token_ids == alone.token_ids  # the profiler only watches
    profiles = engine.step_profiles()
    assert len(profiles) == 2 and engine.step_profiler is None  # disarmed after its two steps
    for p in profiles:
        assert p["wall_ms"] > 0 and len(p["ops"]) <= 25
        own = [o for _, _, o, _ in p["ops"]]
        assert own == sorted(own, reverse=True) and any(name.startswith("aten::") for name, *_ in p["ops"])
    with pytest.raises(ValueError, match="steps must be >= 1"):
        engine.profile_steps(0)


def test_a_request_counts_the_steps_that_ran_another_tenants_work_while_its_tenant_had_none(tiny_zoo):
    # 10 blocks of 16 tokens and no chunked prefill: the victim's whole prompt needs more than half the cache,
    # so nothing is preempted for it, and it waits until the flood's long request lets its blocks go
    engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=10, max_tokens_per_step=512,
                                                 chunked_prefill=False))

    def request(tenant, words, tokens):  # each tenant its own words: no prefix shared through the cache
        return Request(prompt=f"{tenant} " * words, sampling=SamplingParams(max_tokens=tokens, ignore_eos=True),
                       tenant=tenant, owner=f"{tenant}-conn")

    flood = engine.add_request(request("flood", 14, 12))
    engine.step()
    victim = engine.add_request(request("victim", 16, 1))
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    m = final[victim].metrics
    assert final[flood].metrics.passed_over == 0
    assert m.passed_over >= 5 and m.steps_before >= m.passed_over
    assert m.passed_reason.startswith("admit ") and "batch 1;" in m.passed_reason and "tenants 1" in m.passed_reason
