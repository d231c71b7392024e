"""A flooding tenant cannot make another tenant's steps long or keep it out of the KV blocks: the
newcomer's room (blocks as well as a slot) and the per-step token cap of serve/engine/tenancy.py.
Scheduler only, no model: step composition is what the victim's latency follows on CPU."""

from __future__ import annotations

from collections import Counter

import pytest

from serve.engine.block_manager import BlockManager
from serve.engine.scheduler import FairShare, Scheduler, SchedulerConfig, StepPlan
from serve.engine.sequence import Sequence
from serve.engine.tenancy import SEQ_TOKENS, step_caps

_n = iter(range(10**6))


def _seq(tenant, owner=None, n_prompt=30, max_tokens=200, weight=1.0):
    base = 1000 * next(_n)  # distinct prompts: no prefix-cache hits between them
    return Sequence(f"{tenant}-{base}", list(range(base + 1, base + n_prompt + 1)), max_tokens=max_tokens,
                    arrival_time=float(base), owner=owner or tenant, tenant=tenant, tenant_weight=weight)


def _sched(blocks=48, batch=8, cap=True, quiet=True, seq_cap=True, quiet_rate=0.5):
    # the soak's server: 48 blocks of 16 tokens, a batch of 8, the serve defaults' token budgets
    config = SchedulerConfig(max_batch_size=batch, max_tokens_per_step=4096, max_model_len=4096,
                             max_prefill_with_decode=2048, tenant_step_cap=cap, tenant_quiet_prefill=quiet,
                             tenant_seq_cap=seq_cap, tenant_quiet_rate=quiet_rate)
    return Scheduler(config, BlockManager(blocks, 16), FairShare())


def _step(s):
    batch = s.schedule()
    s.postprocess(batch, {q.seq_id: 7 for q, n in batch.entries if q.num_computed_tokens + n == q.num_tokens})
    return batch


def _tokens(batch):
    out = Counter()
    for q, n in batch.entries:
        out[q.tenant] += n
    return out


def _long_flood(s, steps=300):
    """The soak's `long` flood: 256 requests of 200 tokens, run until they hold every block."""
    for _ in range(256):
        s.add(_seq("flood"))
    for _ in range(steps):
        _step(s)


def test_a_victim_gets_kv_blocks_held_by_a_flood_at_its_first_step():
    s = _sched()
    _long_flood(s)
    for _ in range(20):
        for _ in range(7):  # the flood's sequences grow into the free blocks again
            _step(s)
        victim = _seq("victim", max_tokens=2)
        s.add(victim)
        first = _step(s)
        # before: it waited up to 13 steps, until the flood's own growth preempted one of its sequences
        assert any(q is victim for q, _ in first.entries), "the victim was not admitted at its first step"
        while victim.finish_reason is None:
            _step(s)


def test_a_victims_steps_carry_at_most_its_own_tokens_of_the_flood():
    s = _sched()
    _long_flood(s)
    for _ in range(10):
        for _ in range(7):
            _step(s)
        victim = _seq("victim", max_tokens=3)
        s.add(victim)
        while victim.finish_reason is None:
            batch = _step(s)
            if any(q is victim for q, _ in batch.entries):
                mine = _tokens(batch)
                # before: seven flood decodes beside its one decode token, 149 tokens of a
                # preempted flood sequence's recompute beside its 30-token prompt
                assert mine["flood"] <= max(1, mine["victim"]), mine


def test_the_cap_is_the_flood_tenants_not_the_victims():
    """A victim's long prompt beside a flood's decodes is not cut to the flood's few tokens."""
    s = _sched(blocks=400)
    for _ in range(7):
        s.add(_seq("flood"))
    for _ in range(3):
        _step(s)
    s.add(_seq("victim", n_prompt=600, max_tokens=2))
    assert _tokens(_step(s)) == {"flood": 7, "victim": 600}


def test_a_tenant_alone_and_tenants_within_their_share_are_not_capped():
    s = _sched(blocks=400)
    for _ in range(8):
        s.add(_seq("only"))
    for _ in range(3):
        assert _tokens(_step(s)) in ({"only": 240}, {"only": 8})
    a, b = _seq("a", max_tokens=50), _seq("b", n_prompt=4, max_tokens=50)
    assert step_caps([a, b], [], 0) is None  # one sequence each: neither holds more than its share
    two = _sched(blocks=400)
    for tenant in ("a", "a", "b", "b"):
        two.add(_seq(tenant))
    _step(two)
    assert _tokens(_step(two)) == {"a": 2, "b": 2}


def test_weights_set_the_cap_and_the_cap_can_be_turned_off():
    heavy = [_seq("flood", weight=2.0) for _ in range(7)]
    for q in heavy:
        q.num_computed_tokens = q.prompt_len  # decoding
    victim = _seq("victim", weight=1.0)
    victim.num_computed_tokens = victim.prompt_len
    assert step_caps([*heavy, victim], [], 0) == {"flood": 2}  # twice the victim's one token per weight
    s = _sched(cap=False)
    _long_flood(s)
    victim = _seq("victim", max_tokens=3)
    s.add(victim)
    steps = []
    while victim.finish_reason is None:
        steps.append(_tokens(_step(s)))
    assert any(t["flood"] > max(1, t["victim"]) for t in steps if t["victim"]), "off: the flood decodes as before"


def _flood_sequences_beside_a_victim(seq_cap: bool) -> list[int]:
    """The `long` flood's sequences in each step that runs the victim's prefill or decode."""
    s = _sched(quiet=False, seq_cap=seq_cap)
    _long_flood(s)
    beside = []
    for _ in range(10):
        for _ in range(7):
            _step(s)
        victim = _seq("victim", n_prompt=16, max_tokens=2)
        s.add(victim)
        while victim.finish_reason is None:
            batch = _step(s)
            if any(q is victim for q, _ in batch.entries):
                beside.append(sum(q.tenant == "flood" for q, _ in batch.entries))
    return beside


def test_a_victims_steps_run_few_flood_sequences():
    # tokens alone: its 16-token prefill carried 16 flood decode tokens, one from each of up to 7 sequences
    assert max(_flood_sequences_beside_a_victim(seq_cap=False)) > SEQ_TOKENS
    beside = _flood_sequences_beside_a_victim(seq_cap=True)
    # its prefill: 16 tokens' worth, SEQ_TOKENS a sequence; its decode step: one token, one sequence
    assert len(beside) >= 20 and max(beside) == 16 // SEQ_TOKENS and min(beside) == 1, beside


def test_the_serve_key_reaches_the_engines_scheduler(tiny_zoo):
    from omegaconf import OmegaConf

    from serve import Engine, EngineConfig
    from vlora.config import compose

    overrides = ["engine.tenant_step_cap=false", "engine.tenant_quiet_prefill=true", "engine.tenant_seq_cap=false",
                 "engine.tenant_quiet_rate=1"]
    values = OmegaConf.to_container(compose("serve", overrides).engine, resolve=True)
    config = EngineConfig.from_dict({**values, "device": "cpu", "num_kv_blocks": 32})
    assert config.tenant_step_cap is False and config.tenant_quiet_prefill is True and config.tenant_seq_cap is False
    scheduler = Engine(tiny_zoo["qwen2_vl_tiny"], config).scheduler
    assert scheduler.config.tenant_step_cap is False and scheduler.config.tenant_quiet_prefill is True
    assert scheduler.config.tenant_seq_cap is False and scheduler.config.tenant_quiet_rate == 1
    assert EngineConfig(device="cpu").tenant_quiet_rate == compose("serve", []).engine.tenant_quiet_rate == 0.5


@pytest.mark.parametrize("rate", [0, -0.5, 1.5, float("nan"), float("inf"), True, "0.5"])
def test_a_quiet_rate_out_of_range_is_refused_before_a_model_loads(rate):
    from serve import EngineConfig

    with pytest.raises(ValueError, match=r"tenant_quiet_rate=.*give a number above 0 and at most 1"):
        EngineConfig(device="cpu", tenant_quiet_rate=rate)
    with pytest.raises(ValueError, match="tenant_quiet_rate"):
        SchedulerConfig(max_batch_size=8, max_tokens_per_step=64, tenant_quiet_rate=rate)


def test_a_newcomer_whose_first_chunk_needs_over_half_the_cache_preempts_no_one():
    s = _sched()
    _long_flood(s)
    running = len(s.running)
    s.add(_seq("victim", n_prompt=16 * 30, max_tokens=2))  # 30 of the 48 blocks
    before = s.num_preemptions
    assert s._make_room(StepPlan()) == []
    assert s.num_preemptions == before and len(s.running) == running


def _one_token_flood(s, make=lambda: _seq("flood", n_prompt=70, max_tokens=1)):
    """The soak's `topup` floods: 32 one-token requests kept waiting; returns the top-up to call before each step."""
    flood: list = []

    def top_up():
        flood[:] = [q for q in flood if q.finish_reason is None]
        while len(flood) < 32:
            q = make()
            s.add(q)
            flood.append(q)

    return top_up


def test_a_flood_of_one_token_requests_is_capped_though_it_holds_no_running_sequence():
    # the soak's `topup` floods: each request finishes in the step that admits it, so at a step's start
    # the flood holds nothing running; counted by running sequences alone it was never over its share,
    # and each of the victim's steps carried seven flood prefills (490 tokens beside its 70 and its 1)
    s = _sched()
    top_up = _one_token_flood(s)
    for _ in range(50):
        top_up()
        _step(s)
    for _ in range(10):
        victim = _seq("victim", n_prompt=70, max_tokens=2)
        s.add(victim)
        steps = 0
        while victim.finish_reason is None:
            top_up()
            batch = _step(s)
            steps += 1
            mine = _tokens(batch)
            assert mine["victim"] > 0, "a step without the victim while it had work"
            assert mine["flood"] <= max(1, mine["victim"]), mine
            if steps > 1:  # its decode step stays a decode step: no flood prompt chunk turns it into a prefill
                assert batch.decode_only, batch.entries
        assert steps == 2  # its prompt, then its second token
        for _ in range(3):  # the flood alone again: it fills the batch
            top_up()
            assert _tokens(_step(s))["flood"] >= 7 * 70


def _with_picture(seq, offset=10, tokens=40):
    from types import SimpleNamespace

    seq.state.vision = (SimpleNamespace(offset=offset, num_tokens=tokens, content_hash=f"pic-{seq.request_id}"),)
    return seq


def test_a_capped_chunk_stops_before_a_picture_it_cannot_take_whole():
    # the tower encodes a whole picture whatever the chunk: a flood's one-token chunk reaching its picture
    # put the picture's encoding inside the victim's decode step (not quiet: a quiet step holds out every
    # flood chunk, so none would reach a picture in the victim's prompt steps)
    s = _sched(quiet=False)
    top_up = _one_token_flood(s, lambda: _with_picture(_seq("flood", n_prompt=70, max_tokens=1)))
    for _ in range(30):
        top_up()
        _step(s)
    begun = 0
    for _ in range(10):
        victim = _with_picture(_seq("victim", n_prompt=70, max_tokens=6))
        s.add(victim)
        while victim.finish_reason is None:
            top_up()
            batch = s.schedule()
            decoding = victim.num_computed_tokens >= victim.prompt_len
            for q, n in batch.entries:
                start = q.num_computed_tokens
                if q.tenant == "flood" and start <= 10 < start + n:
                    begun += 1
                    assert not decoding, f"a flood chunk [{start}, {start + n}) began its picture in a victim decode step"
            s.postprocess(batch, {q.seq_id: 7 for q, n in batch.entries if q.num_computed_tokens + n == q.num_tokens})
    assert begun > 0  # in the victim's prompt steps its 70-token level lets a flood picture in


def test_a_cached_prefix_counts_on_neither_side_of_the_cap():
    """A victim wants the tokens past its cached prefix, as a capped flood's prompts are charged. Counted
    whole, a victim of 32 tokens with 16 cached (a chat template and question it shares with the flood)
    let two flood prompts of 16 new tokens each in beside it."""
    assert _cached_prefix_step(_sched(quiet=False)) == {"victim": 16, "flood": 16}  # before: flood 32
    # quiet: the victim's 16 new tokens fit in the step, so the flood carries no prompt beside them
    assert _cached_prefix_step(_sched()) == {"victim": 16}


def _cached_prefix_step(s):
    """The victim's first step's tokens by tenant: a victim of 32 tokens, 16 of them cached, beside a flood
    of one-token requests sharing that prefix."""
    prefix = list(range(900_001, 900_017))  # one block, cached by the first request

    def seq(tenant, owner):
        base = 1000 * next(_n)
        return Sequence(f"{tenant}-{base}", prefix + list(range(base + 1, base + 17)), max_tokens=1,
                        arrival_time=float(base), owner=owner, tenant=tenant)

    s.add(seq("first", "first"))
    _step(s)
    for i in range(16):  # the flood keeps its one-token requests queued over four connections
        s.add(seq("flood", f"flood-{i % 4}"))
    _step(s)
    s.add(seq("victim", "victim"))
    batch = _step(s)
    assert {q.tenant: q.num_computed_tokens for q, _ in batch.entries}["victim"] == 32
    return dict(_tokens(batch))


def test_a_light_tenants_prompt_step_carries_no_flood_prompt_and_the_flood_keeps_its_steps():
    # the soak's `queue2048` on an H200: capped to the victim's own tokens, one flood prompt still rode in
    # each of the victim's prefills and took its step from 3.9-5.0 to 7.7-8.2 ms in the slowest tenth
    s = _sched()
    top_up = _one_token_flood(s, lambda: _seq("flood", n_prompt=14, max_tokens=1))
    for _ in range(20):
        top_up()
        _step(s)
    flood_steps = 0
    for _ in range(30):  # a closed-loop victim: its next request once the last is answered
        victim = _seq("victim", n_prompt=16, max_tokens=2)
        s.add(victim)
        while victim.finish_reason is None:
            top_up()
            mine = _tokens(_step(s))
            assert mine["victim"] > 0, "a step without the victim while it had work"
            assert mine["flood"] == 0, mine  # its prompt step is quiet; its decode step was already capped
        for _ in range(2):  # the victim's gap: the flood alone fills the batch
            top_up()
            flood_steps += _tokens(_step(s))["flood"] >= 7 * 14
    assert flood_steps == 60
    assert s.num_quiet_steps == 30


@pytest.mark.parametrize("rate, share", [(0.5, 1 / 3), (1.0, 1 / 2), (0.25, 1 / 5)])
def test_quiet_steps_are_at_most_their_share_of_all_whatever_light_tenants_send(rate, share):
    """Light tenants sending back to back cannot hold a flood's prompts out of most steps: the scheduler
    grants at most rate / (1 + rate) of the steps (`tenant_quiet_rate`) after its saved-up QUIET_BURST."""
    from serve.engine.scheduler import QUIET_BURST

    s = _sched(batch=16, quiet_rate=rate)
    top_up = _one_token_flood(s, lambda: _seq("flood", n_prompt=14, max_tokens=1))
    steps, with_flood = 300, 0
    for _ in range(steps):
        top_up()
        for k in range(3):  # three light tenants, each with a fresh one-token request every step
            if not any(q.tenant == f"light{k}" for q in s.running + s.waiting):
                s.add(_seq(f"light{k}", n_prompt=16, max_tokens=1))
        with_flood += _tokens(_step(s))["flood"] > 0
    assert s.num_quiet_steps <= steps * share + QUIET_BURST
    assert s.num_quiet_steps >= steps * share - 1  # the light tenants got their share
    assert with_flood >= steps - s.num_quiet_steps


def test_backlogged_tenants_make_no_step_quiet():
    """A tenant within its share whose prompts its share of the step cannot finish is not light: tenants
    share such steps by weight (test_tenant_fairness), none held out."""
    s = _sched(blocks=4000, batch=16)
    for _ in range(12):
        s.add(_seq("flood", n_prompt=3000, max_tokens=1))
    for _ in range(4):  # 12,000 prompt tokens: six steps of its 2,048
        s.add(_seq("other", n_prompt=3000, max_tokens=1))
    for _ in range(5):
        mine = _tokens(_step(s))
        assert mine["flood"] > 0 and mine["other"] > 0, mine
    assert s.num_quiet_steps == 0
