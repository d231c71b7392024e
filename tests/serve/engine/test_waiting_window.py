"""The waiting window: each step looks at a tenant's earliest `waiting_window` waiting sequences (in the fair
order, a connection's first before anyone's second); the rest wait in the tenant's backlog and move up as
these leave. Nothing is lost or reordered within a connection, and a step's work does not grow with a queue."""

from __future__ import annotations

from collections import Counter

import pytest

from serve.engine.block_manager import BlockManager
from serve.engine.scheduler import FairShare, Scheduler, SchedulerConfig
from serve.engine.sequence import Sequence

_n = iter(range(10**6))


def _seq(tenant, owner="c", n_prompt=8, max_tokens=1):
    base = 1000 * next(_n)  # distinct prompts, increasing arrival times
    return Sequence(f"{tenant}-{owner}-{base}", list(range(base + 1, base + n_prompt + 1)), max_tokens=max_tokens,
                    arrival_time=float(base), owner=owner, tenant=tenant)


def _sched(window, batch=4, budget=64):
    config = SchedulerConfig(max_batch_size=batch, max_tokens_per_step=budget, max_model_len=4096,
                             waiting_window=window)
    return Scheduler(config, BlockManager(4096, 4), FairShare())


def _drain(s, steps=10_000):
    order = []
    for _ in range(steps):
        if not s.has_unfinished():
            return order
        batch = s.schedule()
        order += [q.request_id for q, n in batch.entries if q.num_computed_tokens == 0]
        s.postprocess(batch, {q.seq_id: 7 for q, n in batch.entries if q.num_computed_tokens + n == q.num_tokens})
    raise AssertionError("the queue did not drain")


def test_a_long_queue_waits_in_the_backlog_and_runs_in_the_order_it_would_have():
    seqs = [_seq("a") for _ in range(40)]
    windowed, whole = _sched(window=4), _sched(window=None)
    for q in seqs:
        windowed.add(q)
    assert len(windowed.waiting) == 4 and windowed.num_backlogged == 36 and windowed.num_queued == 40
    assert [q.request_id for q in windowed.waiting] == [q.request_id for q in seqs[:4]]
    for q in seqs:
        whole.add(Sequence(q.request_id, list(q.token_ids), 1, arrival_time=q.arrival_time, owner="c", tenant="a"))
    assert _drain(windowed) == _drain(whole) == [q.request_id for q in seqs]
    assert windowed.num_queued == 0 and not windowed.backlog


def test_a_new_connection_is_looked_at_behind_another_connections_thousands():
    s = _sched(window=8)
    for _ in range(2000):
        s.add(_seq("a", "c1"))
    newcomer = _seq("a", "c2")
    s.add(newcomer)
    assert newcomer in s.waiting and len(s.waiting) == 8
    assert Counter(q.owner for q in s.waiting) == {"c1": 7, "c2": 1}
    first = s.schedule()
    assert newcomer in [q for q, _ in first.entries], "the fair order puts a connection's first request first"


def test_the_window_is_per_tenant_and_another_tenant_is_admitted_at_once():
    s = _sched(window=16, batch=8)
    for owner in range(8):
        for _ in range(256):
            s.add(_seq("flood", f"c{owner}"))
    victim = _seq("victim", "v")
    s.add(victim)
    assert len(s.waiting) == 17 and s.num_backlogged == 2048 - 16
    assert Counter(q.owner for q in s.waiting if q.tenant == "flood") == {f"c{i}": 2 for i in range(8)}
    batch = s.schedule()
    assert victim in [q for q, _ in batch.entries]


def test_a_refill_takes_the_connection_with_the_fewest_in_the_window():
    s = _sched(window=2)
    c1 = [_seq("a", "c1") for _ in range(3)]
    for q in c1:
        s.add(q)
    c2 = [_seq("a", "c2") for _ in range(3)]
    for q in c2:
        s.add(q)
    assert s.waiting == [c1[0], c2[0]], "c2's first displaced c1's second"
    s.abort(c1[0].request_id)
    assert s.waiting == [c2[0], c1[1]], "c1 had none left in the window: its next moves up, not c2's"


def test_a_backlogged_request_can_be_aborted_and_the_rest_move_up():
    s = _sched(window=2)
    seqs = [_seq("a") for _ in range(6)]
    for q in seqs:
        s.add(q)
    assert s.abort(seqs[4].request_id) is seqs[4] and seqs[4].finish_reason == "abort"
    assert s.num_backlogged == 3
    assert s.abort(seqs[0].request_id) is seqs[0]  # a windowed one: the backlog's head moves up
    assert [q.request_id for q in s.waiting] == [seqs[1].request_id, seqs[2].request_id]
    assert s.abort("nobody") is None
    assert _drain(s) == [seqs[i].request_id for i in (1, 2, 3, 5)]


def test_a_preempted_sequence_is_looked_at_again_whatever_the_window_holds():
    s = _sched(window=2, batch=2)
    runner = _seq("a", max_tokens=50)
    s.add(runner)
    s.schedule()
    for _ in range(5):
        s.add(_seq("a"))
    s._preempt(s.running.pop())
    assert runner in s.waiting and len(s.waiting) == 3
    assert len(_drain(s)) == 6


@pytest.mark.parametrize("window", [0, -1, True, 2.5, "64"])
def test_a_window_that_is_not_a_positive_integer_is_refused(window):
    from serve.engine.config import EngineConfig

    with pytest.raises(ValueError, match="waiting_window"):
        SchedulerConfig(waiting_window=window)
    with pytest.raises(ValueError, match="waiting_window"):
        EngineConfig(device="cpu", waiting_window=window)


def test_the_engine_counts_and_serves_its_backlog(tiny_zoo):
    from serve import Engine, EngineConfig, Request, SamplingParams

    engine = Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(device="cpu", num_kv_blocks=64, max_batch_size=4,
                                                             max_tokens_per_step=64, waiting_window=3))
    requests = [Request(prompt_token_ids=[5 + i, 6, 7, 8], tenant="t", owner="c",
                        sampling=SamplingParams(max_tokens=2, ignore_eos=True)) for i in range(12)]
    ids = [engine.add_request(r) for r in requests]
    assert engine.num_waiting() == 12 and engine.stats().waiting == 12 and len(engine.scheduler.waiting) == 3
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert sorted(finished) == sorted(ids) and engine.stats().waiting == 0
