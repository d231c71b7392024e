"""The server's door and a connection's lifetime, against a real `vlora serve` on loopback:
unauthenticated floods from one address never lock out a client from another, an idle
authenticated connection is closed, and introspection tells a client nothing about the server."""

from __future__ import annotations

import json
import resource
import selectors
import socket
import struct
import threading
import time

import numpy as np
import pytest
import rpyc
from rpc_server import TOKEN, ServerProcess, flood_room
from rpyc.core import consts
from rpyc.core.stream import SocketStream

from serve.rpc.auth import client_handshake
from serve.rpc.client import CLIENT_CONFIG

NAME = "qwen2_vl_tiny"
FLOOD = 1000
IDLE_S = 1.5
ATTACKER, VICTIM = "127.0.0.2", "127.0.0.3"


@pytest.fixture(scope="module")
def server(tiny_zoo, vlora_home):
    soft, hard = flood_room(FLOOD + 256, ATTACKER)
    # one sequence at a time: a request queued behind a long one gets no event for seconds (a long poll)
    proc = ServerProcess(tiny_zoo[NAME], vlora_home, f"rpc.idle_timeout_s={IDLE_S}", "engine.max_batch_size=1")
    yield proc
    proc.stop()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _connect(port: int, source: str = VICTIM, config=CLIENT_CONFIG):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    client_handshake(sock, TOKEN)
    return rpyc.connect_stream(SocketStream(sock), config=dict(config))


def _served_in(port: int) -> float:
    """Seconds from connecting (from VICTIM) to the server's answer to a call."""
    start = time.monotonic()
    conn = _connect(port)
    try:
        assert json.loads(conn.root.health())["ok"]
        return time.monotonic() - start
    finally:
        conn.close()


def _submit(conn, max_tokens: int) -> str:
    spec = {"prompt": "How many cars?", "frames": [{"format": "raw", "shape": [32, 32, 3], "dtype": "uint8"}],
            "sampling": {"max_tokens": max_tokens, "ignore_eos": True}}
    return json.loads(conn.root.submit_image(json.dumps(spec), (bytes(32 * 32 * 3),)))["request_id"]


def _finishes(conn, request_id: str, timeout_s: float = 60.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if any(e["type"] == "final" for e in json.loads(conn.root.poll(request_id, 0.5))["events"]):
            return True
    return False


def _generates(port: int) -> bool:
    conn = _connect(port)
    try:
        return _finishes(conn, _submit(conn, 2))
    finally:
        conn.close()


class Flood:
    """FLOOD sockets from `sources` (ATTACKER) that never finish a handshake (a byte every 0.2 s when
    trickling), each reopened as soon as the server drops it (when reopening), from a thread of its own."""

    def __init__(self, port: int, trickle: bool, reopen: bool, sources: tuple[str, ...] = (ATTACKER,)):
        self.port, self.trickle, self.reopen, self.sources = port, trickle, reopen, sources
        self.socks: set[socket.socket] = set()
        self.opened = self.dropped = 0
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        for _ in range(FLOOD):
            self._open()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self) -> None:
        try:
            source = self.sources[self.opened % len(self.sources)]
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=1, source_address=(source, 0))
        except OSError:  # the backlog is full for a moment
            return
        sock.setblocking(False)
        self.socks.add(sock)
        self._selector.register(sock, selectors.EVENT_READ)
        self.opened += 1

    def _run(self) -> None:
        next_trickle = time.monotonic()
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.05):  # readable: the server closed it
                self._selector.unregister(key.fileobj)
                self.socks.discard(key.fileobj)
                key.fileobj.close()
                self.dropped += 1
                if self.reopen:
                    self._open()
            if self.trickle and time.monotonic() >= next_trickle:
                next_trickle += 0.2
                for sock in list(self.socks):
                    try:
                        sock.send(b"V")
                    except OSError:
                        pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.socks:
            sock.close()
        self._selector.close()


@pytest.mark.alone
@pytest.mark.parametrize("trickle", [False, True], ids=["idle", "trickling"])
@pytest.mark.parametrize("reopen", [False, True], ids=["once", "reopened"])
def test_a_flood_from_one_address_never_locks_out_another(server, trickle, reopen):
    # today: 64 idle sockets (the handshake limit) refused 79 of 80 real clients' connections; now
    # at most rpc.max_handshakes_per_address of one address wait, a new one displacing the longest idle
    threads = _threads(server)
    flood = Flood(server.port, trickle, reopen)
    try:
        time.sleep(0.5)  # the server accepts (and drops) the flood meanwhile
        assert _threads(server) <= threads + 2  # pending sockets cost no thread (they had one each)
        waits = [_served_in(server.port) for _ in range(5)]
        print(f"flood {'trickling' if trickle else 'idle'}, {'reopened' if reopen else 'once'}: answered in "
              f"{', '.join(f'{w * 1e3:.0f}' for w in waits)} ms; {flood.opened} opened, {flood.dropped} dropped")
        assert max(waits) < 1.0, waits
        assert _generates(server.port)
        assert flood.dropped >= FLOOD - 64, (flood.opened, flood.dropped)  # the door kept only a few
    finally:
        flood.close()
    assert server.alive()


def _threads(server) -> int:
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


@pytest.mark.alone
def test_a_flood_from_many_addresses_displaces_its_own_oldest(server):
    # 200 addresses, 5 sockets each: no address reaches its bound, all of them the total one; each
    # new socket displaces the one idle longest, so a real client's socket lives long enough
    flood = Flood(server.port, trickle=False, reopen=True, sources=tuple(f"127.0.1.{i}" for i in range(1, 201)))
    try:
        time.sleep(0.5)
        waits = [_served_in(server.port) for _ in range(5)]
        print(f"flood from 200 addresses, reopened: answered in {', '.join(f'{w * 1e3:.0f}' for w in waits)} ms; "
              f"{flood.opened} opened, {flood.dropped} dropped")
        assert max(waits) < 1.0, waits
        conn = _connect(server.port)
        counters = json.loads(conn.root.metrics("json"))["server"]
        conn.close()
        assert counters["handshakes_displaced"] > 0 and counters["handshakes_passed"] > 0  # the operator sees the door
    finally:
        flood.close()


def test_an_idle_authenticated_connection_is_closed(server):
    # today a connection that authenticated and then said nothing held its slot forever
    active, idle = _connect(server.port), _connect(server.port)
    try:
        before = json.loads(active.root.health())["connections"]
        idle.root.health()
        for _ in range(int(IDLE_S * 2 / 0.5) + 2):  # a message every 0.5 s: never idle
            time.sleep(0.5)
            assert json.loads(active.root.health())["ok"]
        with pytest.raises((EOFError, ConnectionError)):  # the server closed it
            idle.root.health()
        assert json.loads(active.root.health())["connections"] == before - 1  # its slot is back
    finally:
        active.close()
        idle.close()


@pytest.mark.parametrize("trickle", [False, True], ids=["stalled", "trickling"])
def test_a_message_that_does_not_come_whole_in_time_is_dropped(server, trickle):
    # RPyC retried a timed-out read forever: half a message, then silence (or a byte now and then),
    # held a thread and a connection slot for good
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=(VICTIM, 0))
    try:
        client_handshake(sock, TOKEN)
        start = time.monotonic()
        sock.sendall(struct.pack("!LB", 1000, 0) + b"x" * 10)  # RPyC's frame header: 1,000 bytes; 10 come
        sock.settimeout(0.3)
        while time.monotonic() - start < IDLE_S + 1.5:
            try:
                if trickle:
                    sock.send(b"x")
                if sock.recv(1) == b"":
                    break
            except socket.timeout:
                continue
            except OSError:  # reset: closed too
                break
        assert IDLE_S - 0.1 < time.monotonic() - start < IDLE_S + 1  # closed at the message's deadline
    finally:
        sock.close()


def test_a_long_poll_is_not_idle(server):
    # the idle clock runs only between messages: a poll that waits longer than the idle timeout for
    # a request queued behind a long one keeps its connection
    conn = _connect(server.port)
    try:
        long, short = _submit(conn, 600), _submit(conn, 2)  # ~5 s of tokens on this machine's CPU, then 2
        start = time.monotonic()
        conn.root.poll(short, 5.0)
        assert time.monotonic() - start > IDLE_S  # the poll outlasted the idle timeout...
        assert _finishes(conn, short) and _finishes(conn, long)  # ...and the connection stayed
    finally:
        conn.close()


LEAKS = ("VLoRA" + "Service", "serve.", "rpc", "state", "tickets", "_submit", "on_connect", "loop", "0x",
         "object at", "get_service")


def _text_of(call) -> str:
    try:
        return repr(call())
    except Exception as e:  # refused: the error's words must not leak either
        return f"{type(e).__name__}: {e}"


def test_introspection_tells_nothing_about_the_server(server):
    # today repr(conn.root) named the service's class, module and address; dir and INSPECT listed
    # internal methods; id packs carried the dotted class name and two addresses
    conn = _connect(server.port, config={**CLIENT_CONFIG, "allow_safe_attrs": True})
    try:
        root = conn.root
        pack = object.__getattribute__(root, "____id_pack__")
        assert pack[1:] == (0, 1), pack  # no address, the connection's first reference
        names = dir(root)
        assert {"submit_image", "submit_video", "poll", "health"} <= set(names)
        assert all(not n.startswith("_") for n in names), names
        texts = [repr(pack), repr(names), type(root).__name__, _text_of(lambda: repr(root)),
                 _text_of(lambda: str(root)), _text_of(lambda: root.__class__), _text_of(lambda: hash(root)),
                 _text_of(lambda: root == root), _text_of(lambda: conn.sync_request(consts.HANDLE_INSPECT, pack))]
        for handler in (consts.HANDLE_REPR, consts.HANDLE_STR, consts.HANDLE_DIR, consts.HANDLE_BUFFITER,
                        consts.HANDLE_CALL, consts.HANDLE_CMP, consts.HANDLE_PICKLE):
            texts.append(_text_of(lambda: conn.sync_request(handler, root, *{
                consts.HANDLE_BUFFITER: (1,), consts.HANDLE_CALL: ((), ()), consts.HANDLE_CMP: (root, "__eq__"),
                consts.HANDLE_PICKLE: (2,)}.get(handler, ()))))
        for name in ("__class__", "__dict__", "__doc__", "__init__", "__module__", "__repr__", "__new__", "state",
                     "_submit", "exposed_get_service_name", "get_service_name", "on_connect", "x" * 10_000):
            for handler, args in ((consts.HANDLE_GETATTR, ()), (consts.HANDLE_CALLATTR, ((), ()))):
                text = _text_of(lambda: conn.sync_request(handler, root, name, *args))
                texts.append(text.replace(f"'{name[:64]}", "'"))  # the refusal may name what was asked, no more
        method = conn.sync_request(consts.HANDLE_GETATTR, root, "poll")
        texts += [_text_of(lambda: repr(method)), _text_of(lambda: method.__doc__),
                  _text_of(lambda: conn.sync_request(consts.HANDLE_GETATTR, method, "__self__")),
                  _text_of(lambda: conn.sync_request(consts.HANDLE_GETATTR, method, "__func__"))]
        for text in texts:
            assert len(text) < 400 and not any(word in text for word in LEAKS), text
        assert json.loads(root.health())["ok"] and json.loads(method("c0-0", 0.0))["ok"] is False
    finally:
        conn.close()


def test_references_a_client_holds_are_bounded(server):
    # every getattr of a method left one object in the server's table until the client let go of it
    from serve.rpc.sealed import MAX_REFERENCES

    conn = _connect(server.port)
    try:
        held = []
        with pytest.raises(AttributeError, match="references"):
            for _ in range(MAX_REFERENCES + 1):
                held.append(conn.sync_request(consts.HANDLE_GETATTR, conn.root, "health"))
        assert len(held) == MAX_REFERENCES - 1  # the root is one
        held.clear()  # released: calls go on
        assert json.loads(conn.root.health())["ok"]
    finally:
        conn.close()


@pytest.mark.parametrize("setting", [{"max_handshakes_per_address": 0}, {"max_handshakes": 0},
                                     {"first_byte_timeout_s": 0.0}, {"handshake_timeout_s": float("nan")},
                                     {"idle_timeout_s": -1.0}, {"idle_timeout_s": float("inf")}])
def test_a_bad_door_setting_is_refused_by_name(setting):
    from serve.rpc.guarded import GuardedServer
    from serve.rpc.service import VLoRAService

    (key, value), = setting.items()
    with pytest.raises(ValueError, match=f"rpc.{key}="):
        GuardedServer(VLoRAService, hostname="127.0.0.1", port=0, **setting)


def test_a_flood_reopened_faster_than_a_line_arrives_never_displaces_another_address():
    # with the total bound reached, the longest idle socket of all used to go: a flood reopening
    # sockets from one address soon made a real client's (newer than the flood's oldest, still
    # without its line) the longest idle, and displaced it. Now the address holding the most gives one up.
    from serve.rpc.door import HandshakeDoor

    listener = socket.create_server(("127.0.0.1", 0))
    lines, flood = [], []
    door = HandshakeDoor(listener, lambda sock, line: lines.append(line), lambda reason: None, lambda e: None,
                         max_total=4, max_per_address=4, first_byte_timeout_s=30, handshake_timeout_s=30)
    port = listener.getsockname()[1]

    def arrive(source: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
        door.wait(0.2)
        return sock

    try:
        flood += [arrive("127.0.0.2") for _ in range(4)]
        victim = arrive("127.0.0.3")  # its line comes late: it is slow, or the machine is busy
        flood += [arrive("127.0.0.2") for _ in range(12)]  # reopened: each newer than the victim's
        victim.sendall(b"VLORA-AUTH/1 token-of-the-victim\n")
        for _ in range(10):
            door.wait(0.1)
        assert lines == [b"VLORA-AUTH/1 token-of-the-victim"]
        assert door.counters["handshakes_displaced"] >= 12
    finally:
        for sock in flood:
            sock.close()
        door.close()
        listener.close()
