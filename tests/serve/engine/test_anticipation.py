"""Anticipation: when a tenant's last request finishes while another tenant has work, the serving loop
waits up to about that tenant's usual gap for its next request, so that request does not wait behind a
whole step of the others'. Only a tenant whose gap is known and short is waited for, an aborted request
opens no wait, and the waits take at most half of the loop's time whatever the tenants do."""

from __future__ import annotations

import math
import time

import pytest

from serve.engine import Engine, EngineConfig, Request, SamplingParams
from serve.engine.anticipation import BUDGET_RATE, SLACK, Anticipation
from serve.rpc.loop import EngineLoop, Ticket

MS = 1e-3


def _learned(gap_ms: float, max_ms: float = 10.0) -> Anticipation:
    """Tenant "v" has had one gap of `gap_ms` (its request at 0 finished at 1 s, the next came after), and
    tenant "flood" holds two requests all along."""
    a = Anticipation(max_ms, now=0.0)
    a.taken_in("flood", 0.0)
    a.taken_in("flood", 0.0)
    a.taken_in("v", 0.0)
    a.gone("v", 1.0, finished=True)
    a.taken_in("v", 1.0 + gap_ms * MS)
    return a


def test_no_wait_until_a_gap_of_the_tenant_is_known():
    a = Anticipation(10.0, now=0.0)
    a.taken_in("flood", 0.0)
    a.taken_in("flood", 0.0)
    a.taken_in("v", 0.0)
    a.gone("v", 1.0, finished=True)
    assert a.wait_s(1.0) == 0.0  # its first finish: nothing known of it yet
    a.taken_in("v", 1.004)
    a.gone("v", 2.0, finished=True)
    assert a.wait_s(2.0) == pytest.approx(SLACK * 4 * MS)


def test_the_wait_runs_out_at_twice_the_gap_and_ends_when_the_tenant_comes():
    a = _learned(3.0)
    a.gone("v", 2.0, finished=True)
    assert a.wait_s(2.0) == pytest.approx(6 * MS)
    assert a.wait_s(2.004) == pytest.approx(2 * MS)
    assert a.wait_s(2.007) == 0.0  # run out
    a.taken_in("v", 2.009)  # late: still learned
    assert a.stats()["late"] == 1 and a.window("v") == pytest.approx(SLACK * (3 + 0.3 * (9 - 3)) * MS)
    a.gone("v", 3.0, finished=True)
    assert a.wait_s(3.0) > 0
    a.taken_in("v", 3.002)
    assert a.wait_s(3.002) == 0.0 and a.stats()["came_back"] == 1
    a.gone("v", 4.0, finished=True)
    a.taken_in("v", 4.001)  # no wait was for it this time: not counted
    assert a.stats()["came_back"] == 1


def test_a_tenant_whose_gap_is_long_is_never_waited_for_and_waits_never_pass_max_ms():
    slow = _learned(40.0)
    slow.gone("v", 2.0, finished=True)
    assert slow.window("v") == 0.0 and slow.wait_s(2.0) == 0.0
    near = _learned(8.0)  # twice the gap would be 16 ms: max_ms holds it to 10
    near.gone("v", 2.0, finished=True)
    assert near.wait_s(2.0) == pytest.approx(10 * MS)


def test_one_pause_does_not_stop_the_waits_but_long_gaps_still_do():
    """A client idle for a second (between its probes alone and under a flood) came back to no waits for
    its next 8-12 requests: the pause had put its average gap far over max_ms."""
    a = _learned(3.0, max_ms=20.0)
    a.gone("v", 2.0, finished=True)
    a.taken_in("v", 4.0)  # a 2 s pause
    a.gone("v", 5.0, finished=True)
    assert a.wait_s(5.0) > 0  # its very next return is waited for again
    a.taken_in("v", 6.0)  # a second long gap in a row
    a.gone("v", 7.0, finished=True)
    assert a.window("v") == 0.0 and a.wait_s(7.0) == 0.0  # gaps that stay long end the waits


def test_an_abort_or_another_request_still_in_the_engine_opens_no_wait():
    a = _learned(2.0)
    a.taken_in("v", 2.0)
    a.taken_in("v", 2.0)
    a.gone("v", 2.1, finished=True)
    assert a.wait_s(2.1) == 0.0  # one of its requests is still in the engine
    a.gone("v", 2.2, finished=False)
    assert a.wait_s(2.2) == 0.0  # its last one was aborted: its client may be gone


def test_no_tenant_is_held_for_one_that_had_as_many_requests_in_the_engine():
    a = _learned(2.0)  # "v" had one request at a time; "flood" holds two
    a.gone("flood", 1.5, finished=True)
    a.gone("v", 2.0, finished=True)
    assert a.wait_s(2.0) == 0.0  # "flood" holds one now, as many as "v" had: its request is not held for "v"
    a.taken_in("v", 2.001)
    a.taken_in("flood", 2.001)
    a.taken_in("v", 2.001)
    a.taken_in("v", 2.001)  # "v" holds 3 now, and "flood" 2
    for t in ("v", "v", "v"):
        a.gone(t, 2.1, finished=True)
    assert a.wait_s(2.1) == 0.0  # "v" had three at once, more than "flood" holds
    # the flooding tenant's own idle moments hold no one's request, however short its gaps
    b = Anticipation(10.0, now=0.0)
    for spell in range(3):
        for _ in range(8):
            b.taken_in("flood", spell)
        b.taken_in("v", spell)
        for _ in range(8):
            b.gone("flood", spell + 0.5, finished=True)
        assert b.wait_s(spell + 0.5) == 0.0  # "v" holds a request, fewer than the 8 "flood" had
        b.gone("v", spell + 0.6, finished=True)


def test_the_longest_open_wait_of_several_tenants():
    a = _learned(2.0)
    for t, gap in (("w", 4.0),):
        a.taken_in(t, 0.0)
        a.gone(t, 1.0, finished=True)
        a.taken_in(t, 1.0 + gap * MS)
    a.gone("v", 2.0, finished=True)
    a.gone("w", 2.0, finished=True)
    assert a.wait_s(2.0) == pytest.approx(8 * MS)


def test_waits_take_at_most_half_the_clock_whatever_the_tenants_do():
    a = _learned(5.0)
    now, waited = 2.0, 0.0
    for _ in range(2000):  # the tenant comes back at the last moment, again and again
        a.gone("v", now, finished=True)
        w = a.wait_s(now)
        a.waited(w)
        waited += w
        now += w
        a.taken_in("v", now)
        now += 1 * MS  # its request's step
    elapsed = now - 2.0
    assert waited <= BUDGET_RATE * elapsed + 8 * 10 * MS + 1e-9
    assert waited > 0.4 * elapsed  # and the budget is spent, not hoarded
    spent = a.stats()
    a.waited(1.0)  # the budget overdrawn: the next return is not one waited for
    a.gone("v", now, finished=True)
    assert a.wait_s(now) == 0.0
    a.taken_in("v", now + 1 * MS)
    assert a.stats()["came_back"] == spent["came_back"] and a.stats()["late"] == spent["late"]


@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, 1001, True, "5"])
def test_the_setting_is_checked(value):
    with pytest.raises(ValueError, match="anticipate_ms"):
        EngineConfig(device="cpu", anticipate_ms=value)


# ---- a real engine and its serving loop ----------------------------------------------------------

def _request(tenant: str, rid: str, tokens: int) -> Request:
    return Request(prompt=f"Count to {tokens}, {rid}.", sampling=SamplingParams(max_tokens=tokens, ignore_eos=True),
                   request_id=rid, tenant=tenant, owner=f"{tenant}-conn")


def _engine(tiny_zoo, anticipate_ms) -> Engine:
    return Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(device="cpu", num_kv_blocks=256, anticipate_ms=anticipate_ms,
                                                          policy="fcfs"))


def _finish(engine: Engine, rid: str) -> None:
    for _ in range(200):
        if any(out.request_id == rid and out.finished for out in engine.step()):
            return
    raise AssertionError(f"{rid} did not finish")


def test_the_engine_asks_for_a_wait_only_while_another_tenant_has_work(tiny_zoo):
    engine = _engine(tiny_zoo, 500.0)
    engine.add_request(_request("flood", "f0", 200))
    engine.add_request(_request("flood", "f1", 200))  # two in the engine: more than the victim's one
    engine.add_request(_request("victim", "v0", 1))
    _finish(engine, "v0")
    assert engine.linger_s() == 0.0  # its first gap is not known yet
    time.sleep(0.05)
    engine.add_request(_request("victim", "v1", 1))
    _finish(engine, "v1")
    assert engine.linger_s() > 0.05  # a gap of about 50 ms: waited for up to twice it
    engine.add_request(_request("victim", "v2", 1))
    assert engine.linger_s() == 0.0  # it came
    _finish(engine, "v2")
    engine.abort("f0")
    engine.add_request(_request("victim", "v3", 1))
    _finish(engine, "v3")
    assert engine.linger_s() == 0.0  # the flood holds one request now, as many as the victim had
    engine.abort("f1")
    engine.step()
    assert not engine.has_unfinished() and engine.linger_s() == 0.0  # nobody else has work: nothing to hold
    off = _engine(tiny_zoo, None)
    assert off.stats().anticipation is None and off.linger_s() == 0.0


def test_the_loop_holds_the_others_steps_for_a_tenant_about_to_come_back(tiny_zoo):
    engine = _engine(tiny_zoo, 1000.0)
    loop = EngineLoop(engine).start()
    try:
        def send(tenant, rid, tokens) -> Ticket:
            ticket = Ticket(rid, owner=f"{tenant}-conn")
            loop.submit(_request(tenant, rid, tokens), ticket)
            return ticket

        floods = [send("flood", f"f{i}", 1500) for i in range(2)]  # still decoding when the victim is done
        assert send("victim", "v0", 1).finished.wait(30)
        time.sleep(0.3)  # the victim's gap: 0.3 s, so it is waited for up to 0.6 s from now on
        assert send("victim", "v1", 1).finished.wait(30)
        steps = engine.num_steps
        time.sleep(0.2)  # inside the victim's window: the flood's steps are held
        held = engine.num_steps - steps
        assert not any(f.finished.is_set() for f in floods)  # the flood had steps to run all along
        v2 = send("victim", "v2", 1)
        assert v2.finished.wait(30)
        timing = [e for e in v2.take(1.0) if e["type"] == "final"][0]["timing"]
        assert timing["lingered_before_ms"] < 50  # the wait its arrival ended is not charged to it (0.2 s of it)
        stats = engine.stats().anticipation
        assert held == 0, f"{held} step(s) ran while the victim was about to come back"
        assert stats["waits"] >= 1 and stats["waited_ms"] >= 150 and stats["came_back"] >= 1
        for i, f in enumerate(floods):
            loop.abort(f"f{i}")
            assert f.finished.wait(30)
    finally:
        loop.stop()
