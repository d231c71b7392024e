"""The gate paced across front-end processes (serve/rpc/shared_clock.py): a tenant is paced only when it
is the heaviest of the tenants calling in every process, at its part of the share split with them;
two gates on one clock stand for two processes (the clock's rows are all they share), and one test
reads a row written by a spawned process."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from serve.rpc.gate import Gate
from serve.rpc.shared_clock import SharedClock

pytestmark = pytest.mark.alone  # pacing measured on the clock: no other test's load beside it


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _gates(share: float = 0.2) -> tuple[Gate, Gate]:
    clock = SharedClock(3)
    server, tenant = Gate(slots=1, share=share, overhead_s=0.0, burst_s=0.005), \
        Gate(slots=1, share=share, overhead_s=0.0, burst_s=0.005)
    server.share_clock(clock, 0)
    tenant.share_clock(clock, 1)
    return server, tenant


def _flood(gate: Gate, tenant: str, calls: int, cpu_s: float) -> float:
    start = time.monotonic()
    for _ in range(calls):
        with gate.call("c", tenant):
            _burn(cpu_s)
    return time.monotonic() - start


def test_a_lone_tenant_in_its_process_is_paced_at_the_whole_share():
    _, tenant = _gates(share=0.2)
    took = _flood(tenant, "flood", 20, 0.002)  # 40 ms of CPU at 20% of the clock: ~0.2 s
    assert took > 0.15 and tenant.counters["paced_s"] > 0.1


def test_a_flood_in_one_process_is_paced_at_its_part_and_a_victim_in_another_is_not():
    victim_gate, flood_gate = _gates(share=0.1)
    stop = threading.Event()

    def victim():  # light and steady: calling within every second, so it takes its part of the share
        while not stop.is_set():
            with victim_gate.call("v", "victim"):
                _burn(0.0005)
            time.sleep(0.02)

    t = threading.Thread(target=victim)
    t.start()
    try:
        time.sleep(0.05)
        took = _flood(flood_gate, "flood", 20, 0.002)  # 40 ms at 5% (the share split with the victim): ~0.8 s
    finally:
        stop.set()
        t.join(5)
    assert took > 0.6 and flood_gate.counters["paced_s"] > 0.5
    assert victim_gate.counters["paced_s"] == 0  # never the heaviest while the flood uses more


def test_without_the_clock_each_process_sees_its_own_tenant_alone():
    victim_gate, flood_gate = Gate(slots=1, share=0.1, overhead_s=0.0, burst_s=0.005), \
        Gate(slots=1, share=0.1, overhead_s=0.0, burst_s=0.005)
    for _ in range(30):  # the victim alone in its process is the heaviest there: 30 ms of CPU at 10% paces it
        with victim_gate.call("v", "victim"):
            _burn(0.001)
    assert victim_gate.counters["paced_s"] > 0
    # at the whole share (~0.4 s), not split with the victim it cannot see (~0.8 s)
    assert _flood(flood_gate, "flood", 20, 0.002) < 0.6


def test_a_row_written_in_a_spawned_process_is_read_here():
    clock = SharedClock(2)
    now = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
    child = multiprocessing.get_context("spawn").Process(target=clock.publish, args=(1, 2.0, now, 0.3, now))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    weight, heaviest = clock.others(0, time.monotonic(), 1.0)
    assert weight == 2.0 and 0.2 < heaviest <= 0.3
    assert clock.others(1, time.monotonic(), 1.0) == (0.0, 0.0)  # its own row is not an other
    assert clock.others(0, time.monotonic() + 2.0, 1.0) == (0.0, 0.0)  # calling no more after a second


def test_a_clock_needs_a_row():
    with pytest.raises(ValueError, match="at least one row"):
        SharedClock(0)
