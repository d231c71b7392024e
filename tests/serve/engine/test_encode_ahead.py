"""Encoding the next step's pictures while the current step runs (EngineConfig.encode_ahead,
serve/engine/lookahead.py): answers stay those of transformers, nothing is encoded twice, the guess
is the next step's pictures, a picture that fails ahead fails at its own step only, and the RPC loop
takes in arrivals mid-step without reordering an abort or a call."""

from __future__ import annotations

import pytest
import torch
from serve_cases import assert_matches_hf, case_specs, frames, hf_generate, make_request, staggered

from serve import Engine, EngineConfig
from serve.engine.lookahead import upcoming_vision
from serve.rpc.loop import EngineLoop, Ticket

ARCHS = {"qwen2_vl_tiny": "qwen2_vl", "llava_1_5_tiny": "llava"}


def _engine(path, ahead: str, **kw) -> Engine:
    kw = {"num_kv_blocks": 64, "kv_block_size": 8, "max_tokens_per_step": 24, **kw}
    return Engine(path, EngineConfig(device="cpu", encode_ahead=ahead, **kw))


@pytest.mark.parametrize("name", list(ARCHS))
def test_encoding_ahead_keeps_transformers_answers_and_encodes_each_picture_once(name, tiny_zoo):
    specs = case_specs(ARCHS[name])
    refs = [hf_generate(tiny_zoo[name], spec) for spec in specs]
    ahead, plain = _engine(tiny_zoo[name], "on"), _engine(tiny_zoo[name], "off")
    # all at once: the 24-token steps leave the later prompts' pictures for the steps after
    assert_matches_hf(ahead.generate([make_request(s) for s in specs]), refs)
    plain.generate([make_request(s) for s in specs])
    got, want = ahead.stats(), plain.stats()
    assert got.items_encoded_ahead > 0
    assert got.items_encoded == want.items_encoded  # moved earlier, never done twice
    assert want.items_encoded_ahead == 0 and got.blocks_in_use == 0
    # arriving one every two steps, behind running prompts (a clean engine: no cache hits)
    ahead, plain = _engine(tiny_zoo[name], "on"), _engine(tiny_zoo[name], "off")
    assert_matches_hf(staggered(ahead, specs + specs[::-1]), refs + refs[::-1])
    staggered(plain, specs + specs[::-1])
    assert ahead.stats().items_encoded == plain.stats().items_encoded


def test_auto_is_off_on_the_cpu_and_the_setting_is_checked(tiny_zoo):
    assert not Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(device="cpu", num_kv_blocks=32)).encode_ahead
    with pytest.raises(ValueError, match="encode_ahead"):
        EngineConfig(encode_ahead="yes")


def _guesses_and_reads(engine: Engine) -> tuple[list[set], list[set]]:
    """Steps the engine to the end; per step, the pictures it guessed for the next step and those it encoded."""
    guesses, reads = [], []
    ahead, encode = engine.runner.encode_ahead, engine.model.encode

    def guessed(upcoming, ahead_now):
        guesses[-1] = {it.content_hash for _, it in upcoming}
        return ahead(upcoming, ahead_now)

    def encoded(items):
        reads[-1] |= {it.content_hash for it in items}
        return encode(items)

    engine.runner.encode_ahead, engine.model.encode = guessed, encoded
    while engine.has_unfinished():
        guesses.append(set())
        reads.append(set())
        engine.step()
    return guesses, reads


def test_the_guess_is_the_pictures_the_next_step_takes(tiny_zoo):
    """One flow in arrival order: what the engine names during a step is what the next step encodes
    (no encoder cache, so the guesses are recorded but not encoded and every step encodes its own; no
    prefix cache: a prefix the running step is computing is not cached yet when the guess is made)."""
    engine = _engine(tiny_zoo["qwen2_vl_tiny"], "on", max_batch_size=8, encoder_cache_items=0,
                     enable_prefix_cache=False)
    for seed in range(4):
        engine.add_request(make_request(dict(prompt="Which way?", video=frames(seed, n=4, side=56))))
    guesses, reads = _guesses_and_reads(engine)
    assert len(reads) > 4 and sum(bool(r) for r in reads) > 2
    for step in range(len(reads) - 1):
        assert guesses[step] == reads[step + 1], step


def test_a_picture_that_fails_ahead_fails_at_its_own_step(tiny_zoo):
    engine = _engine(tiny_zoo["qwen2_vl_tiny"], "on", max_batch_size=8, enable_prefix_cache=False)
    good = engine.add_request(make_request(dict(prompt="Which way?", video=frames(1))))
    bad = engine.add_request(make_request(dict(prompt="Which way?", video=frames(2))))
    poisoned = {it.content_hash for it in engine.scheduler.waiting[1].state.vision}
    encode = engine.model.encode

    def failing(items):
        if any(it.content_hash in poisoned for it in items):
            raise RuntimeError("corrupt picture")
        return encode(items)

    engine.model.encode = failing
    failed_with = None
    while engine.has_unfinished() and failed_with is None:
        try:
            engine.step()
        except RuntimeError:
            failed_with = engine.last_batch
    assert failed_with is not None and bad in failed_with  # raised where the bad request itself ran
    assert engine.runner.counters["encode_ahead_failures"] == 1  # tried ahead first, quietly, and only once


def test_the_loop_takes_arrivals_mid_step_but_holds_an_abort_and_what_follows(tiny_zoo):
    engine = _engine(tiny_zoo["qwen2_vl_tiny"], "on")
    loop = EngineLoop(engine)
    loop.start = None  # never started: the test drives the engine thread's methods itself
    reqs = [make_request(dict(prompt=f"Which way, {i}?", video=frames(i))) for i in range(3)]
    tickets = [Ticket(f"r{i}", owner="c") for i in range(3)]
    for r, t in zip(reqs, tickets):
        r.request_id = t.request_id
    loop.submit(reqs[0], tickets[0])
    loop.submit(reqs[1], tickets[1])
    loop.abort("r0")
    loop.submit(reqs[2], tickets[2])
    loop._take_arrivals()
    assert [s.request_id for s in engine.scheduler.waiting] == ["r0", "r1"]
    assert loop._held == ("abort", "r0")
    loop._take_arrivals()  # still held: nothing behind the abort jumps it
    assert len(engine.scheduler.waiting) == 2
    loop._drain(block=False)
    assert [s.request_id for s in engine.scheduler.waiting] == ["r1", "r2"] and loop._held is None
    assert tickets[0].events.get_nowait()["finish_reason"] == "abort"


def _flows(engine: Engine, count: int, n_frames: int = 6) -> None:
    for i in range(count):  # each camera its own connection, as the server makes them
        request = make_request(dict(prompt="Which way?", video=frames(10 + i, n=n_frames, side=56)))
        request.owner = f"camera-{i}"
        engine.add_request(request)


def test_with_many_flows_the_guess_follows_the_fair_shares(tiny_zoo):
    engine = _engine(tiny_zoo["qwen2_vl_tiny"], "on", max_batch_size=8, encoder_cache_items=0,
                     enable_prefix_cache=False, max_tokens_per_step=32)
    _flows(engine, 8, n_frames=16)
    guesses, reads = _guesses_and_reads(engine)
    pairs = [(guesses[k], reads[k + 1]) for k in range(len(reads) - 1) if reads[k + 1]]
    right = sum(len(g & r) for g, r in pairs)
    assert len(pairs) > 3 and right >= 0.8 * sum(len(r) for _, r in pairs), pairs
    # and few guessed that the next step does not take (a guess of every flow's whole prompt would)
    wrong = sum(len(guesses[k] - reads[k + 1]) for k in range(len(reads) - 1))
    assert wrong <= 0.2 * sum(len(g) for g in guesses), (wrong, guesses)


def test_with_a_small_cache_and_many_flows_no_picture_is_encoded_twice(tiny_zoo):
    """Pictures guessed too early are held by their own sequence, not by the cache that would push them out."""
    counts = []
    for ahead in ("on", "off"):
        engine = _engine(tiny_zoo["qwen2_vl_tiny"], ahead, max_batch_size=8, encoder_cache_items=4,
                         enable_prefix_cache=False, max_tokens_per_step=32)
        _flows(engine, 8)
        while engine.has_unfinished():
            engine.step()
        counts.append((engine.stats().items_encoded, engine.stats().items_encoded_ahead))
    (ahead_total, ahead_part), (plain_total, _) = counts
    assert ahead_part > 0 and ahead_total == plain_total == 8 * 3


def test_pictures_encoded_ahead_stay_with_their_sequence_when_the_cache_drops_them(tiny_zoo):
    engine = _engine(tiny_zoo["qwen2_vl_tiny"], "off", encoder_cache_items=2, enable_prefix_cache=False)
    want = engine.generate(make_request(dict(prompt="Which way?", video=frames(5)))).token_ids
    engine = _engine(tiny_zoo["qwen2_vl_tiny"], "off", encoder_cache_items=2, enable_prefix_cache=False)
    rid = engine.add_request(make_request(dict(prompt="Which way?", video=frames(5))))
    (seq,) = engine.scheduler.waiting
    items = seq.state.vision
    assert len(items) >= 2 and engine.runner.encode_ahead([(seq, it) for it in items[:2]], 0) == 2
    for key in ("other-0", "other-1"):  # the cache's two places go to other pictures
        engine.runner.encoder_cache.put(key, torch.zeros(1))
    assert all(it.content_hash not in engine.runner.encoder_cache for it in items[:2])
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert final[rid].token_ids == want
    assert engine.stats().items_encoded == len(items)  # the two held ones were not encoded again


@pytest.mark.parametrize("quiet", [False, True])
def test_the_guess_holds_a_flooding_tenant_to_its_step_cap(tiny_zoo, quiet):
    """A tenant flooding one-token image requests beside another tenant's running request: each step
    carries one flood picture (the step cap; with quiet steps none in the victim's first), and the guess
    names only that one, not the seven a batch of eight would have room for."""
    engine = _engine(tiny_zoo["qwen2_vl_tiny"], "on", max_batch_size=8, encoder_cache_items=0,
                     enable_prefix_cache=False, max_tokens_per_step=4096, tenant_quiet_prefill=quiet)
    victim = make_request(dict(prompt="Which way?", images=frames(1, n=1, side=56)), max_new=8)
    victim.tenant = "victim"
    engine.add_request(victim)
    for i in range(12):
        request = make_request(dict(prompt="Which way?", images=frames(40 + i, n=1, side=56)), max_new=1)
        request.tenant, request.owner = "flood", f"flood-{i % 4}"
        engine.add_request(request)
    guesses, reads = _guesses_and_reads(engine)
    # the victim's picture and one of the flood's; quiet, the victim's alone (its prompt fits its share)
    assert len(reads) > 8 and len(reads[0]) == (1 if quiet else 2)
    for step in range(6):  # the victim runs 8 steps: the guesses made while it ran into the next
        assert guesses[step] == reads[step + 1], step  # before: seven flood pictures guessed at step 0
        assert len(reads[step + 1]) <= 1, reads[step + 1]
