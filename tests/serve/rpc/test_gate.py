"""The gate in front of service code: at most K calls inside, blocking waits outside, tenants taking
turns, the connection threads' share of the clock, and every exposed method going through it."""

from __future__ import annotations

import threading
import time

import pytest

from serve.rpc.gate import GATE, Gate
from serve.rpc.replies import guarded

pytestmark = pytest.mark.alone  # pacing measured on the clock: no other test's load beside it


def _run_all(targets):
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def test_at_most_slots_calls_run_inside_at_once():
    gate = Gate(slots=2, share=1.0)
    inside, peak, lock = [0], [0], threading.Lock()

    def call(i):
        with gate.call(f"c{i}", "t"):
            with lock:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
            time.sleep(0.01)
            with lock:
                inside[0] -= 1

    _run_all([lambda i=i: call(i) for i in range(8)])
    assert peak[0] == 2 and gate.in_use() == 0 and gate.counters["calls"] == 8


def test_a_blocking_wait_inside_released_holds_no_slot():
    gate = Gate(slots=1, share=1.0)
    waiting, go, other_done = threading.Event(), threading.Event(), threading.Event()

    def poller():
        with gate.call("c1", "t"):
            with gate.released():  # e.g. poll waiting for its request's events
                assert not gate.held() and gate.in_use() == 0
                waiting.set()
                go.wait(5)
            assert gate.held()

    t = threading.Thread(target=poller)
    t.start()
    assert waiting.wait(5)
    with gate.call("c2", "t"):  # the one slot is free while c1 waits
        other_done.set()
    go.set()
    t.join(5)
    assert other_done.is_set() and gate.in_use() == 0
    with gate.released():  # outside any call: nothing to give back
        assert not gate.held()


def test_a_wait_left_inside_a_call_stalls_the_others_only_briefly():
    gate = Gate(slots=1, share=1.0)
    inside, go = threading.Event(), threading.Event()

    def stuck():
        with gate.call("c1", "t"):  # blocks without released(): the slot looks stuck
            inside.set()
            go.wait(5)

    t = threading.Thread(target=stuck)
    t.start()
    assert inside.wait(5)
    start = time.monotonic()
    with gate.call("c2", "t"):
        waited = time.monotonic() - start
    go.set()
    t.join(5)
    assert waited < 1.0 and gate.counters["stuck"] == 1 and gate.in_use() == 0


def test_a_tenant_calling_now_and_then_goes_ahead_of_a_flooding_tenant():
    gate = Gate(slots=1, share=1.0)
    order, lock = [], threading.Lock()
    gate.enter("holder", "flood")  # the slot is taken: everyone below queues

    def call(conn, tenant):
        with gate.call(conn, tenant):
            with lock:
                order.append(tenant)

    flood = [threading.Thread(target=call, args=(f"f{i}", "flood")) for i in range(8)]
    for t in flood:
        t.start()
    while gate.counters["waited"] < 8:
        time.sleep(0.001)
    victim = threading.Thread(target=call, args=("v", "victim"))
    victim.start()
    while gate.counters["waited"] < 9:
        time.sleep(0.001)
    gate.leave()
    for t in (*flood, victim):
        t.join(5)
    assert len(order) == 9 and order.index("victim") <= 1  # not behind the flood's 8 queued calls


def test_the_connection_threads_use_at_most_their_share_of_the_clock():
    def burn(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def run(share):
        gate = Gate(slots=1, share=share, overhead_s=0.0, burst_s=0.005)
        start = time.monotonic()
        for _ in range(20):  # one connection calling in a loop, 2 ms of CPU a call: 40 ms of CPU
            with gate.call("c", "t"):
                burn(0.002)
        return time.monotonic() - start, gate.counters["paced_s"]

    _, unpaced = run(1.0)
    paced, slept = run(0.2)
    assert unpaced < 0.01 and slept > 0.1 and paced > 0.15  # 40 ms of CPU at 20%: ~0.2 s of clock


def test_a_tenant_over_its_part_of_the_clock_waits_and_the_others_do_not():
    gate = Gate(slots=1, share=0.1, overhead_s=0.0, burst_s=0.005)
    with gate.call("f1", "flood"):  # 30 ms of CPU at a 5% part of the clock: ~0.6 s owed
        end = time.thread_time() + 0.03
        while time.thread_time() < end:
            pass
    flood_done = []
    flood = threading.Thread(target=lambda: (gate.enter("f2", "flood"), gate.leave(), flood_done.append(1)))
    flood.start()
    time.sleep(0.02)
    start = time.monotonic()
    with gate.call("v", "victim"):
        waited = time.monotonic() - start
    assert waited < 0.25 and not flood_done  # the flood's next call still pays (~0.5 s), asleep, holding no slot
    flood.join(5)
    assert flood_done and gate.counters["paced_s"] > 0.2
    by_tenant = gate.tenant_metrics()  # whose calls were paced, for the operator's metrics
    assert by_tenant["flood"]["gate_paced_ms"] > 200 and by_tenant["flood"]["gate_pace_sleeps"] >= 1
    assert by_tenant["victim"] == {"gate_calls": 1, "gate_waited": 0, "gate_pace_sleeps": 0, "gate_paced_ms": 0}


def test_cpu_charged_outside_the_calls_is_paced_like_theirs():
    """What a tenant's HTTP requests cost on the event loop (charge) makes its next call wait as a
    call's own CPU would; a tenant charged nothing goes in at once."""
    gate = Gate(slots=1, share=0.1, overhead_s=0.0, burst_s=0.005)
    for connection, tenant in (("f1", "flood"), ("v0", "victim")):
        with gate.call(connection, tenant):
            pass  # both busy now, with a budget each
    gate.charge("flood", 0.03)  # ~0.6 s owed at its 5% part of the clock
    gate.charge("victim", 0.0)  # nothing: no-op
    start = time.monotonic()
    with gate.call("v", "victim"):
        assert time.monotonic() - start < 0.1
    start = time.monotonic()
    with gate.call("f2", "flood"):
        assert time.monotonic() - start > 0.2
    assert gate.counters["paced_s"] > 0.2


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_tenant_that_was_not_the_heaviest_pays_for_one_call_not_for_all_it_made_meanwhile():
    """The victim calls, 10 ms of CPU each, while a flood's one big call keeps the flood the heaviest: it is
    not paced then. When it turns the heaviest, its first sleep pays for about one call at its part of
    the clock (~0.2 s), not for every call it made while the flood used more (~1 s)."""
    gate = Gate(slots=1, share=0.1, overhead_s=0.0, burst_s=0.005)
    with gate.call("f", "flood"):
        _burn(0.06)
    waits = []
    for _ in range(30):
        start = time.monotonic()
        with gate.call("v", "victim"):
            waits.append(time.monotonic() - start)
            _burn(0.01)
        if gate.tenant_metrics()["victim"]["gate_pace_sleeps"]:
            break
    assert gate.tenant_metrics()["victim"]["gate_pace_sleeps"] == 1, (waits, gate.tenant_metrics())
    assert max(waits[:-1]) < 0.05 and 0.1 < waits[-1] < 0.5, waits


def test_a_tenants_many_threads_pace_one_at_a_time_without_waking_each_other():
    gate = Gate(slots=1, share=0.1, overhead_s=100e-6, burst_s=0.005)
    stop = threading.Event()
    calls = []

    def flood(i):
        while not stop.is_set():
            with gate.call(f"f{i}", "flood"):
                end = time.thread_time() + 0.0002
                while time.thread_time() < end:
                    pass
            calls.append(1)

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(10)
    assert calls and gate.counters["paced_s"] > 0.5  # paced nearly all the second, one thread at a time
    # a sleep per call at most (and the last ones'), not the herd of 16 waking each time the budget came back
    # (that took thousands of sleeps a second and most of a core)
    assert gate.counters["pace_sleeps"] <= len(calls) + 16, (gate.counters["pace_sleeps"], len(calls))


def test_bad_limits_are_refused_with_the_value_named():
    with pytest.raises(ValueError, match="slots"):
        Gate(slots=0)
    with pytest.raises(ValueError, match="share"):
        Gate(share=0.0)
    with pytest.raises(ValueError, match="share"):
        GATE.configure(1, 5.0, 1e-4, 0.02)
    assert GATE.share == 0.5  # a refused configure changes nothing


def test_every_exposed_method_runs_inside_the_gate_and_gives_its_slot_back():
    class Counts:
        def count(self, key):
            pass

    class Service:
        conn_id = "c0"
        state = Counts()

        @guarded
        def exposed_ok(self):
            return {"held": GATE.held(), "in_use": GATE.in_use()}

        @guarded
        def exposed_fails(self):
            raise RuntimeError("boom")

    svc = Service()
    svc.state.ids = iter(range(10))
    assert svc.exposed_ok() == {"held": True, "in_use": 1}
    assert '"internal"' in svc.exposed_fails()
    assert '"bad_argument"' in svc.exposed_ok(object())  # refused arguments go through the gate too
    assert GATE.in_use() == 0 and not GATE.held()


def test_a_tenant_sees_only_its_own_turns_at_the_gate_and_the_operator_every_tenants(tiny_zoo, tmp_path):
    """metrics()["gate"] from one front end serving every tenant (no tenant processes): a tenant's view
    holds its own counts alone, the operator's every tenant's."""
    from serve.engine import Engine, EngineConfig
    from serve.rpc import Client, RpcServer, TenantRegistry, add_tenant

    path = tmp_path / "tenants.yaml"
    tokens = {who: add_tenant(path, who, "operator" if who == "ops" else "tenant") for who in ("ops", "a", "b")}
    engine = Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(device="cpu", num_kv_blocks=16, max_batch_size=2))
    with RpcServer(engine, TenantRegistry.from_file(path), "127.0.0.1", 0) as server:
        clients = {who: Client("127.0.0.1", server.port, token, reconnect=False) for who, token in tokens.items()}
        try:
            for _ in range(3):
                clients["a"].health(), clients["b"].health()
            views = {who: c.metrics()["gate"] for who, c in clients.items()}
        finally:
            for c in clients.values():
                c.close()
    assert set(views["a"]) == {"a"} and set(views["b"]) == {"b"}, views
    assert {"a", "b", "ops"} <= set(views["ops"]) and views["ops"]["a"]["gate_calls"] >= 3, views
