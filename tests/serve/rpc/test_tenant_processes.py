"""A front-end process per tenant, against a real `vlora serve` with a tenants file: each tenant's
connections are served by a process of its own (a child of the server, attached to the engine
process), the operator's by the server's process; quotas, adapters and the pixel budget still hold
across them; a tenant process that dies takes only its own tenant's requests with it, and that
tenant's next connection is served by a new one."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from rpc_server import ServerProcess, children

from serve.rpc import Client, ServerError, add_tenant
from serve.rpc.tenant_processes import check_limit, check_pacing

NAME = "qwen2_vl_tiny"
FRAME = np.full((32, 32, 3), 60, np.uint8)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenant_processes") / "tenants.yaml"
    tokens = {"ops": add_tenant(path, "ops", "operator"), "victim": add_tenant(path, "victim"),
              "flood": add_tenant(path, "flood", quotas={"queued": 3})}
    return path, tokens


@pytest.fixture(scope="module")
def server(tiny_zoo, vlora_home, tenants):
    # asked for: `auto` gives none on a machine of 4 cores or fewer
    proc = ServerProcess(tiny_zoo[NAME], vlora_home, f"rpc.tenants={tenants[0]}", "engine.max_batch_size=4",
                         "rpc.tenant_processes=8", "rpc.tenant_process_nice=3",
                         # paced against each other over the shared clock, at a share small enough that a loop of
                         # calls from one connection is always over its part
                         "rpc.pace_tenant_processes=true", "rpc.gate_share=0.1")
    yield proc
    proc.stop()


def test_auto_gives_a_process_per_tenant_paced_where_they_cannot_each_have_a_core():
    assert check_limit("auto") == 8 and check_limit(3) == 3 and check_limit(0) == 0
    for bad in (-1, 2.5, True, "all", None):
        with pytest.raises(ValueError, match="rpc.tenant_processes"):
            check_limit(bad)
    # paced where the processes outnumber the cores left beside the engine's and the door's 4
    assert [check_pacing("auto", 8, cores=c) for c in (1, 2, 4, 8, 11, 12, 16, 128)] == [True] * 5 + [False] * 3
    assert check_pacing("auto", 2, cores=6) is False and check_pacing("auto", 3, cores=6) is True
    assert check_pacing(False, 8, cores=2) is False and check_pacing(True, 1, cores=128) is True  # as given
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="rpc.pace_tenant_processes"):
            check_pacing(bad, 8)


def _client(server, tenants, who: str) -> Client:
    return Client("127.0.0.1", server.port, tenants[1][who], reconnect=False)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            inodes.add(target)
    return inodes


def _tcp_inodes(port: int) -> set[str]:
    """socket:[inode] of every TCP socket of this host whose local or remote port is `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            ports = {int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16)}
            if port in ports:
                out.add(f"socket:[{cols[9]}]")
    return out


def _server_of(server, client: Client) -> int:
    """The pid holding the server's end of `client`'s connection: the server's or one of its children."""
    local_port = client._conn._channel.stream.sock.getsockname()[1]
    deadline = time.monotonic() + 10
    while True:
        ends = _tcp_inodes(local_port)
        holders = [pid for pid in (server.proc.pid, *children(server.proc.pid)) if _socket_inodes(pid) & ends]
        if len(holders) == 1 or time.monotonic() > deadline:  # the server's copy closes right after the hand-off
            assert len(holders) == 1, holders
            return holders[0]
        time.sleep(0.05)


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of stat: the niceness


def _answer(client: Client) -> list[int]:
    return client.submit_image("How many?", [FRAME], sampling={"max_tokens": 3, "ignore_eos": True}).result(60)[
        "token_ids"]


def _metrics(server, tenants) -> dict:
    with _client(server, tenants, "ops") as ops:
        return ops.metrics()["server"]


def test_each_tenant_is_served_by_a_process_of_its_own_and_the_operator_by_the_server(server, tenants):
    with _client(server, tenants, "victim") as victim, _client(server, tenants, "flood") as flood, \
            _client(server, tenants, "ops") as ops:
        answers = {who: _answer(c) for who, c in (("victim", victim), ("flood", flood), ("ops", ops))}
        assert answers["victim"] == answers["flood"] == answers["ops"]  # one engine, the same base model
        pids = {who: _server_of(server, c) for who, c in (("victim", victim), ("flood", flood), ("ops", ops))}
    assert pids["ops"] == server.proc.pid
    assert pids["victim"] != pids["flood"] and server.proc.pid not in (pids["victim"], pids["flood"])
    assert {pids["victim"], pids["flood"]} <= children(server.proc.pid)
    # rpc.tenant_process_nice: the tenant processes yield the cores to the server's (and the engine's)
    assert _nice(pids["victim"]) == _nice(pids["flood"]) == _nice(server.proc.pid) + 3
    deadline = time.monotonic() + 10  # a tenant process reports its counters about once a second
    while _metrics(server, tenants)["requests_image"] < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    server_counters = _metrics(server, tenants)
    assert server_counters["tenant_processes"] == 2
    assert server_counters["requests_image"] == 3  # the tenant processes' counters are summed in


def _paced_ms(server, tenants) -> int:
    """The gate's pacing summed over the front ends, once the tenant processes have reported."""
    time.sleep(1.5)  # a tenant process reports its counters about once a second
    return _metrics(server, tenants)["gate_paced_ms"]


def test_a_tenant_calling_in_a_loop_is_paced_in_its_own_process_while_another_calls(server, tenants):
    with _client(server, tenants, "victim") as victim, _client(server, tenants, "flood") as flood:
        _answer(victim), _answer(flood)  # both processes up
        before = _paced_ms(server, tenants)
        with _client(server, tenants, "ops") as ops:
            gates_before = ops.metrics()["gate"]
        stop = threading.Event()

        def steady():  # the victim calls now and then: it counts among the tenants calling
            while not stop.is_set():
                victim.health()
                time.sleep(0.05)

        t = threading.Thread(target=steady)
        t.start()
        try:
            deadline = time.monotonic() + 1.5
            calls = 0
            while time.monotonic() < deadline:  # the flood calls back to back from its own process
                flood.health()
                calls += 1
        finally:
            stop.set()
            t.join(10)
        paced = _paced_ms(server, tenants) - before
        with _client(server, tenants, "ops") as ops:
            gates = ops.metrics()["gate"]  # the operator sees each tenant's turns
        own = victim.metrics()["gate"]  # a tenant only its own
    # paced in the flood's own process and counted in the server's metrics (unpaced, as with
    # rpc.pace_tenant_processes=false, one connection's calls can never be over the whole clock); the split
    # of the share with the other processes' tenants: tests/serve/rpc/test_shared_clock.py
    assert paced > 200, (paced, calls)
    # by tenant: the flood was paced, the victim calling now and then was not
    since = {t: {k: v - gates_before.get(t, {}).get(k, 0) for k, v in c.items()} for t, c in gates.items()}
    assert since["flood"]["gate_paced_ms"] > 200 and since["flood"]["gate_pace_sleeps"] > 0, (gates_before, gates)
    assert since["victim"]["gate_paced_ms"] == 0 and since["victim"]["gate_calls"] > 10, (gates_before, gates)
    assert set(own) == {"victim"} and own["victim"]["gate_calls"] >= gates["victim"]["gate_calls"], own


def test_quotas_hold_in_a_tenant_process_and_connections_are_counted_by_the_server(server, tenants):
    with _client(server, tenants, "flood") as flood:
        # long enough to be in flight still when the fourth comes, however slowly this (niced) process runs
        handles = [flood.submit_image("Describe.", [FRAME], sampling={"max_tokens": 300, "ignore_eos": True})
                   for _ in range(3)]
        with pytest.raises(ServerError, match="too_many_requests|its limit 3"):
            flood.submit_image("Describe.", [FRAME], sampling={"max_tokens": 2})
        assert _metrics(server, tenants)["connections"] == 2  # this one and the operator's asking
        for handle in handles:
            handle.abort()
            handle.result(120)
    deadline = time.monotonic() + 10
    while _metrics(server, tenants)["connections"] != 1 and time.monotonic() < deadline:
        time.sleep(0.1)  # the tenant process reports the close
    assert _metrics(server, tenants)["connections"] == 1


def test_a_dead_tenant_process_costs_only_its_tenant_and_the_next_connection_gets_a_new_one(server, tenants):
    with _client(server, tenants, "victim") as victim:
        baseline = _answer(victim)
        flood = _client(server, tenants, "flood")
        handles = [flood.submit_image("Describe.", [FRAME], sampling={"max_tokens": 1000, "ignore_eos": True})
                   for _ in range(3)]
        assert handles[0].poll(5)  # running: its first tokens came
        doomed = _server_of(server, flood)
        os.kill(doomed, signal.SIGKILL)
        with pytest.raises(Exception):  # the flood's connection went with its process
            for handle in handles:
                handle.result(60)
        assert _answer(victim) == baseline  # the victim's process and the engine are untouched
        with _client(server, tenants, "flood") as again:
            assert _answer(again) == baseline
            assert _server_of(server, again) not in (doomed, server.proc.pid)
    counters = _metrics(server, tenants)
    assert counters["tenant_processes_died"] == 1
    with _client(server, tenants, "ops") as ops:  # the dead process's requests were aborted in the engine
        deadline = time.monotonic() + 30
        while ops.health().get("in_flight") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ops.health()["in_flight"] == 0
    assert any("went away; 3 request(s) of it aborted" in line for line in server.lines)
    assert server.alive()
