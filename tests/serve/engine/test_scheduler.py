"""Continuous batching without a model: budgets, chunking, admission, preemption, abort, no leaks."""

from __future__ import annotations

import pytest

from serve.engine.block_manager import BlockManager
from serve.engine.scheduler import ArrivalOrder, Scheduler, SchedulerConfig, SchedulingPolicy
from serve.engine.sequence import Sequence, SequenceStatus


def _sched(num_blocks=64, block_size=4, **cfg):
    config = SchedulerConfig(**{"max_model_len": num_blocks * block_size, **cfg})
    return Scheduler(config, BlockManager(num_blocks, block_size))


def _seq(name, n_prompt, max_tokens=4, t=0.0, stop=()):
    base = 1000 * (sum(map(ord, name)) % 97)  # distinct prompts: no prefix-cache hits between them
    return Sequence(name, list(range(base + 1, base + n_prompt + 1)), max_tokens=max_tokens, arrival_time=t,
                    stop_token_ids=frozenset(stop))


def _step(s: Scheduler, token=7):
    """One scheduler step with a fake model that always samples `token`."""
    batch = s.schedule()
    sampled = {seq.seq_id: token for seq, n in batch.entries if seq.num_computed_tokens + n == seq.num_tokens}
    finished = s.postprocess(batch, sampled)
    return batch, finished


def test_budget_chunks_prompts_and_new_requests_join_a_running_batch():
    s = _sched(max_tokens_per_step=16)
    a, b = _seq("a", 10, t=0), _seq("b", 10, t=1)
    s.add(a)
    s.add(b)
    batch, _ = _step(s)
    assert [(q.request_id, n) for q, n in batch.entries] == [("a", 10), ("b", 6)]  # b is chunked
    assert a.num_generated == 1 and b.num_generated == 0
    c = _seq("c", 12, t=2)
    s.add(c)  # arrives while a decodes and b prefills
    batch, _ = _step(s)
    assert [(q.request_id, n) for q, n in batch.entries] == [("a", 1), ("b", 4), ("c", 11)]
    assert not batch.decode_only
    batch, _ = _step(s)
    assert [(q.request_id, n) for q, n in batch.entries] == [("a", 1), ("b", 1), ("c", 1)]
    assert batch.decode_only


def test_prompt_tokens_are_capped_while_someone_decodes():
    s = _sched(max_tokens_per_step=16, max_prefill_with_decode=5)
    a, b = _seq("a", 10, t=0), _seq("b", 10, t=1)
    s.add(a)
    s.add(b)
    batch, _ = _step(s)  # nobody decodes yet: the whole budget
    assert [(q.request_id, n) for q, n in batch.entries] == [("a", 10), ("b", 6)]
    c = _seq("c", 12, t=2)
    s.add(c)
    batch, _ = _step(s)  # a decodes: b's rest and c's first chunk share 5 prompt tokens
    assert [(q.request_id, n) for q, n in batch.entries] == [("a", 1), ("b", 4), ("c", 1)]
    with pytest.raises(ValueError, match="max_prefill_with_decode"):
        SchedulerConfig(max_prefill_with_decode=-1)
    with pytest.raises(ValueError, match="decode_burst"):
        SchedulerConfig(max_prefill_with_decode=0, decode_burst=0)


def test_a_decode_lane_runs_decode_only_steps_and_lets_prompts_in_after_a_burst():
    s = _sched(max_tokens_per_step=16, max_prefill_with_decode=0, decode_burst=3)
    a, b = _seq("a", 10, max_tokens=8, t=0), _seq("b", 10, max_tokens=8, t=1)
    s.add(a)
    s.add(b)
    batch, _ = _step(s)  # nobody decodes yet: the whole budget
    assert [(q.request_id, n) for q, n in batch.entries] == [("a", 10), ("b", 6)]
    c = _seq("c", 4, max_tokens=2, t=2)
    s.add(c)
    shapes, decode_only = [], []
    for _ in range(5):
        batch, _ = _step(s)
        shapes.append([(q.request_id, n) for q, n in batch.entries])
        decode_only.append(batch.decode_only)
    # a decodes: three decode-only steps (b's prompt and c wait), then one step with the whole budget
    assert shapes[:3] == [[("a", 1)]] * 3 and decode_only == [True, True, True, False, True]
    assert shapes[3] == [("a", 1), ("b", 4), ("c", 4)]
    assert shapes[4] == [("a", 1), ("b", 1), ("c", 1)]  # everyone decodes: nothing waits, no burst counted
    while s.has_unfinished():
        _step(s)
    assert [q.num_generated for q in (a, b, c)] == [8, 8, 2] and s.block_manager.num_used_blocks == 0


def test_a_decode_lane_without_waiting_prompts_never_forces_a_prefill_step():
    s = _sched(max_tokens_per_step=16, max_prefill_with_decode=0, decode_burst=1)
    a = _seq("a", 6, max_tokens=6, t=0)
    s.add(a)
    _step(s)
    for _ in range(4):  # only decode work: every step decode-only, however long the run
        batch, _ = _step(s)
        assert [(q.request_id, n) for q, n in batch.entries] == [("a", 1)]
    d = _seq("d", 5, t=1)
    s.add(d)
    batch, _ = _step(s)  # d waits one decode-only step (the burst of 1), then comes in whole
    assert [(q.request_id, n) for q, n in batch.entries] == [("a", 1)]
    batch, _ = _step(s)
    assert [(q.request_id, n) for q, n in batch.entries] == [("d", 5)]  # a finished its 6 tokens


def test_max_batch_size_limits_running_sequences():
    s = _sched(max_batch_size=2)
    seqs = [_seq(f"r{i}", 3, t=i) for i in range(4)]
    for q in seqs:
        s.add(q)
    batch, _ = _step(s)
    assert [q.request_id for q, _ in batch.entries] == ["r0", "r1"]
    while s.has_unfinished():
        batch, _ = _step(s)
        assert len(batch) <= 2
    assert all(q.finish_reason == "length" and q.num_generated == 4 for q in seqs)
    assert s.block_manager.num_used_blocks == 0


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = _sched(max_tokens_per_step=12, chunked_prefill=False)
    a, b = _seq("a", 10, t=0), _seq("b", 5, t=1)
    s.add(a)
    s.add(b)
    batch, _ = _step(s)
    assert [q.request_id for q, _ in batch.entries] == ["a"]  # b (5) does not fit in the 2 left
    batch, _ = _step(s)
    assert [(q.request_id, n) for q, n in batch.entries] == [("a", 1), ("b", 5)]
    with pytest.raises(ValueError, match="chunked prefill off"):
        s.add(_seq("c", 13))


def test_preemption_by_recompute_when_blocks_run_out():
    s = _sched(num_blocks=6, block_size=4, max_tokens_per_step=64)
    a, b = _seq("a", 8, max_tokens=8, t=0), _seq("b", 8, max_tokens=8, t=1)
    s.add(a)
    s.add(b)
    _step(s)  # both prefilled: 2 + 2 blocks, 2 free
    preempted = []
    while s.has_unfinished():
        batch, _ = _step(s)
        preempted += [q.request_id for q in batch.preempted]
        assert s.block_manager.num_used_blocks <= 6
    assert preempted and set(preempted) == {"b"}  # the later arrival gives way
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.num_generated == b.num_generated == 8  # b resumed from its prompt plus its tokens
    assert s.num_preemptions == len(preempted) and s.block_manager.num_used_blocks == 0


def test_a_preempted_sequence_recomputes_its_generated_tokens():
    config = SchedulerConfig(max_tokens_per_step=64, max_model_len=20)
    s = Scheduler(config, BlockManager(5, 4, enable_prefix_cache=False))
    a, b = _seq("a", 7, max_tokens=9, t=0), _seq("b", 7, max_tokens=9, t=1)
    s.add(a)
    s.add(b)
    seen = []
    while s.has_unfinished():
        batch = s.schedule()
        seen += [(n, q.num_generated) for q, n in batch.entries if q is b and n > 1]
        s.postprocess(batch, {q.seq_id: 7 for q, n in batch.entries if q.num_computed_tokens + n == q.num_tokens})
    first, *resumed = seen
    assert first == (7, 0) and resumed  # the recompute covers the prompt and the generated tokens
    assert all(n == 7 + generated for n, generated in resumed)
    assert b.num_generated == 9


def test_stop_tokens_finish_and_abort_frees_everything():
    s = _sched()
    a, b = _seq("a", 5, max_tokens=50, stop=(7,)), _seq("b", 6, max_tokens=50, t=1)
    s.add(a)
    s.add(b)
    _, finished = _step(s, token=7)
    assert a in finished and a.finish_reason == "stop"
    _step(s, token=3)
    assert s.abort("b") is b and b.finish_reason == "abort" and b.status is SequenceStatus.FINISHED
    assert s.abort("nope") is None
    assert not s.has_unfinished() and s.block_manager.num_used_blocks == 0
    c = _seq("c", 4)
    s.add(c)
    assert s.abort("c") is c and not s.waiting


def test_prompts_that_cannot_fit_are_refused():
    s = _sched(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(_seq("long", 16))


def test_the_policy_decides_who_goes_first():
    class LastComeFirst(SchedulingPolicy):
        def order(self, seqs):
            return sorted(seqs, key=lambda q: -q.arrival_time)

    s = Scheduler(SchedulerConfig(max_batch_size=1), BlockManager(16, 4), LastComeFirst())
    s.add(_seq("early", 3, t=0))
    s.add(_seq("late", 3, t=1))
    batch, _ = _step(s)
    assert [q.request_id for q, _ in batch.entries] == ["late"]
    assert ArrivalOrder().order([_seq("y", 1, t=2), _seq("x", 1, t=1)])[0].request_id == "x"


def _owned(name, owner, t, n_prompt=4, max_tokens=4):
    seq = _seq(name, n_prompt, max_tokens=max_tokens, t=t)
    seq.owner = owner
    return seq


def test_owners_take_turns_in_the_fair_order():
    from serve.engine.scheduler import FairShare

    seqs = [_owned(f"a{i}", "a", t=i) for i in range(4)] + [_owned("b0", "b", t=10), _owned("c0", "c", t=11)]
    order = [s.request_id for s in FairShare().order(seqs)]
    assert order == ["a0", "b0", "c0", "a1", "a2", "a3"]
    single = [_owned(f"x{i}", None, t=5 - i) for i in range(3)]
    assert [s.request_id for s in FairShare().order(single)] == ["x2", "x1", "x0"]  # one owner: arrival order


def test_a_full_batch_makes_room_for_an_owner_with_nothing_running():
    from serve.engine.scheduler import FairShare

    s = Scheduler(SchedulerConfig(max_batch_size=2, max_model_len=256), BlockManager(64, 4), FairShare())
    for i in range(3):
        s.add(_owned(f"a{i}", "a", t=i, max_tokens=50))
    _step(s)
    assert {q.request_id for q in s.running} == {"a0", "a1"}
    s.add(_owned("b0", "b", t=10))
    batch, _ = _step(s)
    # a1 (a's latest running) is preempted for b0, which runs this step; a1 does not take its slot back
    assert [q.request_id for q in batch.preempted] == ["a1"] and {q.request_id for q in s.running} == {"a0", "b0"}
    s2 = Scheduler(SchedulerConfig(max_batch_size=2, max_model_len=256), BlockManager(64, 4), FairShare())
    for i in range(3):
        s2.add(_owned(f"a{i}", "a", t=i, max_tokens=50))
    _step(s2)
    batch, _ = _step(s2)  # one owner: work-conserving, nobody is preempted
    assert batch.preempted == [] and {q.request_id for q in s2.running} == {"a0", "a1"}
