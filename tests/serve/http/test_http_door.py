"""The HTTP door against a real engine, RPyC server and HTTP server on loopback: idle and trickling
sockets from one address never lock out a client from another, a request's head has a deadline,
a tenant's kept-alive connections make room from its own, never another tenant's, and a tenant's
requests in progress stop at its connections quota."""

from __future__ import annotations

import asyncio
import resource
import socket
import time

import pytest
from rpc_server import flood_room

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve.rpc import RpcServer, TenantRegistry, add_tenant  # noqa: E402

NAME = "qwen2_vl_tiny"
FLOOD = 1000
ATTACKER, VICTIM = "127.0.0.2", "127.0.0.3"
# a first-byte deadline long enough that a slow machine opens a test's sockets and checks them within it
PER_ADDRESS, TOTAL, FIRST_BYTE_S, HEAD_S = 8, 32, 2.0, 1.0


@pytest.fixture(scope="module")
def server(tiny_zoo, tmp_path_factory):
    from serve import Engine, EngineConfig
    from serve.http import HttpConfig, HttpServer

    soft, hard = flood_room(2 * FLOOD + 256, ATTACKER)  # both ends of every socket in this process
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    tokens = {"ops": add_tenant(path, "ops", "operator"), "two": add_tenant(path, "two", quotas={"connections": 2})}
    engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=64, max_batch_size=4))
    rpc = RpcServer(engine, TenantRegistry.from_file(path)).start()
    http = HttpServer(rpc.state, HttpConfig(port=0, max_pending=TOTAL, max_pending_per_address=PER_ADDRESS,
                                            first_byte_timeout_s=FIRST_BYTE_S, header_timeout_s=HEAD_S,
                                            keep_alive_s=30.0), NAME).start()
    yield {"http": http, "rpc": rpc, "tokens": tokens, "url": f"http://127.0.0.1:{http.port}"}
    http.close()
    rpc.close()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _sock(server, source: str = ATTACKER) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server["http"].port), timeout=10, source_address=(source, 0))


def _served_in(server, who: str = "ops") -> float:
    """Seconds from a new connection (from VICTIM) to the answer of an authenticated request."""
    start = time.monotonic()
    transport = httpx.HTTPTransport(local_address=VICTIM)
    with httpx.Client(transport=transport, timeout=10) as client:
        reply = client.get(server["url"] + "/v1/models", headers={"Authorization": f"Bearer {server['tokens'][who]}"})
    assert reply.status_code == 200, reply.text
    return time.monotonic() - start


def _closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing `sock`, or None when it stayed open `seconds`."""
    sock.settimeout(seconds)
    got = b""
    try:
        while True:
            piece = sock.recv(4096)
            if not piece:
                return got
            got += piece
    except (socket.timeout, TimeoutError):
        return None
    except ConnectionResetError:
        return got


def _door(server):
    return server["http"].door


@pytest.mark.alone
def test_a_thousand_idle_sockets_lock_out_nobody(server):
    flood = [_sock(server) for _ in range(FLOOD)]  # each past the bound closes the address's longest idle
    try:
        assert _served_in(server) < 1.0
        door = _door(server)
        assert len(door.waiting) <= TOTAL
        counters = server["rpc"].state.counters
        assert counters.get("http_door_displaced", 0) >= FLOOD - TOTAL
    finally:
        for s in flood:
            s.close()


def test_a_silent_connection_is_closed_after_the_first_byte_deadline(server):
    sock = _sock(server)
    start = time.monotonic()
    try:
        assert _closed_within(sock, FIRST_BYTE_S + 3.0) == b""
        assert time.monotonic() - start >= FIRST_BYTE_S * 0.9
    finally:
        sock.close()


@pytest.mark.alone
def test_trickling_heads_get_a_408_at_their_deadline(server):
    tricklers = [_sock(server) for _ in range(PER_ADDRESS)]
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 64
    start = time.monotonic()
    open_ = list(tricklers)
    try:
        sent = 0
        while open_ and time.monotonic() - start < HEAD_S + 3.0:
            for s in list(open_):
                try:
                    s.sendall(head[sent:sent + 1] if sent < len(head) else b"a")
                except OSError:
                    open_.remove(s)
            sent += 1
            if sent == 3:  # the victim is served while the heads trickle
                assert _served_in(server) < 1.0
            time.sleep(0.1)
        assert not open_, "a trickling head outlived its deadline"
        assert time.monotonic() - start < HEAD_S + 3.0
        for s in tricklers:
            reply = _closed_within(s, 1.0) or b""
            # the 408 may be lost to a reset when bytes were still coming; never anything else
            assert reply == b"" or reply.startswith(b"HTTP/1.1 408"), reply[:80]
        assert server["rpc"].state.counters.get("http_door_header_timeouts", 0) >= 1
    finally:
        for s in tricklers:
            s.close()


def _kept_alive(server, who: str) -> socket.socket:
    """A connection that made one authenticated request, read its answer, and stays open."""
    sock = _sock(server, VICTIM)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + server["tokens"][who].encode()
                 + b"\r\n\r\n")
    sock.settimeout(10)
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(4096)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(4096)
    return sock


def test_an_address_opening_sockets_one_by_one_keeps_its_bound(server):
    first = [_sock(server) for _ in range(PER_ADDRESS)]
    time.sleep(0.3)  # past the door's grace for a young connection, well within the first-byte deadline
    later = [_sock(server) for _ in range(4)]
    try:
        assert [_closed_within(s, 0.3) for s in first[:4]] == [b""] * 4  # the address's longest idle
        assert _door(server).groups.get(("address", ATTACKER)) == PER_ADDRESS
    finally:
        for s in first + later:
            s.close()


@pytest.mark.alone  # its checks fall between the grace (0.25 s) and the first-byte deadline (2 s)
def test_an_address_that_just_sent_a_request_keeps_its_connections_past_the_bound(server):
    """A live client opening many connections at once, slow to write on some (its own event loop
    busy): an address that started a request within the first-byte deadline is not cut to its bound
    after the grace; its idle ones still close at that deadline."""
    live = "127.0.0.4"
    transport = httpx.HTTPTransport(local_address=live)
    with httpx.Client(transport=transport, timeout=10) as client:
        reply = client.get(server["url"] + "/v1/models", headers={"Authorization": f"Bearer {server['tokens']['ops']}"})
    assert reply.status_code == 200, reply.text
    first = [_sock(server, live) for _ in range(PER_ADDRESS)]
    time.sleep(0.3)  # past the grace, as in the test above, well within the first-byte deadline (2 s)
    later = [_sock(server, live) for _ in range(4)]
    try:
        assert [_closed_within(s, 0.1) for s in first[:4]] == [None] * 4  # none displaced
        assert _door(server).groups.get(("address", live)) == PER_ADDRESS + 4
        assert _closed_within(first[0], FIRST_BYTE_S + 1.0) == b""  # the first-byte deadline still holds
    finally:
        for s in first + later:
            s.close()


def test_a_tenants_idle_connections_make_room_from_its_own(server):
    others = [_kept_alive(server, "ops") for _ in range(3)]
    mine = [_kept_alive(server, "two") for _ in range(TOTAL + 8)]
    try:
        time.sleep(0.2)
        door = _door(server)
        assert door.groups.get(("tenant", "ops")) == 3
        assert door.groups.get(("tenant", "two")) == TOTAL - 3
        assert [_closed_within(s, 0.5) for s in mine[:11]] == [b""] * 11  # its longest idle, closed
        assert [_closed_within(s, 0.1) for s in mine[11:] + others] == [None] * (TOTAL - 3 + 3)  # the rest open
    finally:
        for s in others + mine:
            s.close()


def test_a_real_client_reuses_its_connection(server):
    headers = {"Authorization": f"Bearer {server['tokens']['ops']}"}
    with httpx.Client(transport=httpx.HTTPTransport(local_address=VICTIM), timeout=10) as client:
        for _ in range(2):
            assert client.get(server["url"] + "/v1/models", headers=headers).status_code == 200
            time.sleep(FIRST_BYTE_S + 0.5)  # past a new connection's deadline: a kept-alive one has keep_alive_s
            assert _door(server).groups.get(("tenant", "ops")) == 1  # one connection, waiting as the tenant's


def test_a_tenants_requests_in_progress_stop_at_its_quota(server):
    """Two bodies that never come hold tenant "two"'s quota of 2: its third request is refused 429 at
    once, another tenant is served, and the quota comes back when the slow clients leave."""
    slow = []
    for _ in range(2):
        sock = _sock(server, VICTIM)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\nAuthorization: Bearer " + server["tokens"]["two"].encode() + b"\r\n\r\n")
        slow.append(sock)
    url, body = server["url"] + "/v1/chat/completions", {"model": NAME, "max_tokens": 1,
                                                         "messages": [{"role": "user", "content": "Hi"}]}
    auth = {who: {"Authorization": f"Bearer {server['tokens'][who]}"} for who in ("two", "ops")}
    try:
        for _ in range(50):  # until both heads are read: two requests of "two" in progress
            refused = httpx.post(url, json=body, headers=auth["two"], timeout=60)
            if refused.status_code == 429:
                break
            time.sleep(0.1)
        assert refused.status_code == 429, refused.text
        assert "connections" in refused.json()["error"]["message"]
        assert httpx.post(url, json=body, headers=auth["ops"], timeout=60).status_code == 200
    finally:
        for sock in slow:
            sock.close()
    deadline = time.monotonic() + 5.0
    while (status := httpx.post(url, json=body, headers=auth["two"], timeout=60).status_code) == 429:
        assert time.monotonic() < deadline, "the quota did not come back when the slow clients left"
        time.sleep(0.1)
    assert status == 200


@pytest.mark.alone
def test_each_request_charges_its_event_loop_cpu_to_its_tenant(server, monkeypatch):
    """The gate paces a tenant by its CPU: an HTTP request's share on the event loop is charged to the
    tenant whose token it carried, never to another, and an unauthenticated one to nobody."""
    import serve.http.server as http_server

    charged = []
    monkeypatch.setattr(http_server.GATE, "charge", lambda tenant, seconds: charged.append((tenant, seconds)))
    with httpx.Client(timeout=10) as client:
        for _ in range(5):
            client.get(server["url"] + "/v1/models", headers={"Authorization": f"Bearer {server['tokens']['two']}"})
        assert client.get(server["url"] + "/v1/models").status_code == 401
    assert [t for t, _ in charged] == ["two"] * 5
    assert all(seconds > 0 for _, seconds in charged)


def test_loop_cpu_counts_a_coroutines_own_steps_and_passes_on_its_result_and_errors():
    from serve.http.server import _LoopCpu

    async def busy(seconds: float, fail: bool = False):
        for _ in range(3):
            end = time.thread_time() + seconds / 3
            while time.thread_time() < end:
                pass
            await asyncio.sleep(0.01)  # the other task's steps run here: not counted
        if fail:
            raise ValueError("bad")
        return "done"

    async def main():
        other = asyncio.ensure_future(busy(0.06))
        mine = _LoopCpu(busy(0.03))
        assert await mine == "done"
        await other
        assert 0.025 < mine.seconds < 0.05
        failing = _LoopCpu(busy(0.0, fail=True))
        with pytest.raises(ValueError):
            await failing
        cancelled = asyncio.ensure_future(_wrap(_LoopCpu(asyncio.sleep(10))))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled

    async def _wrap(awaitable):
        return await awaitable

    asyncio.run(main())


def test_the_map_of_live_addresses_is_pruned_in_doublings_not_per_request():
    """Requests from many addresses within the first-byte deadline: every one stays live, and the map is
    rebuilt only when it has doubled (a rebuild per request start would cost the number of addresses each)."""
    from serve.http.door import HttpDoor

    class Proto:  # what the door keeps of a connection: a key, its address
        def __init__(self, address):
            self.door_address = address

    async def main():
        door = HttpDoor(max_pending=2, max_pending_per_address=2, first_byte_timeout_s=30.0, header_timeout_s=30.0,
                        keep_alive_s=30.0, count=lambda reason: None)
        rebuilt, last = 0, door.progress
        for i in range(200):
            proto = Proto(f"10.0.0.{i}")
            door.arrived(proto, proto.door_address)
            door.started(proto)
            rebuilt, last = rebuilt + (door.progress is not last), door.progress
        return door, rebuilt

    door, rebuilt = asyncio.run(main())
    assert not door.waiting and not door.groups
    assert all(door._live(f"10.0.0.{i}") for i in range(200))  # none of the live ones pruned
    assert rebuilt <= 6, f"the map was rebuilt {rebuilt} times for 200 addresses"  # doublings from 8: 5
    door.first_byte_timeout_s = 0.0  # every address stale now: the next prune keeps none of them
    for i in range(door.prune_at + 1 - len(door.progress)):
        door._progressed(f"10.1.0.{i}")
    assert len(door.progress) <= 1
