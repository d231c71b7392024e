"""The HTTP front end's server: uvicorn on a thread of its own over the app, beside (or without) RPyC.

    http = HttpServer(rpc_server.state, HttpConfig(port=8000), base_model="qwen2_vl_tiny").start()
    ...; http.close()

It shares the RPyC server's state (engine loop or process, limits, tenants, quotas, counters), so
both front ends serve one engine under one budget. The socket is bound here, before start() returns.
Requests in progress past http.max_concurrent are answered 503 at once, a tenant's past its connections
quota 429; connections without a request
in progress are the door's (serve/http/door.py: deadlines, bounds per address and per tenant); a body
must arrive within http.body_timeout_s.
"""

from __future__ import annotations

import json
import socket
import threading
import time

from serve.rpc.gate import GATE
from serve.rpc.state import ServerState

from .config import HttpConfig
from .door import HttpDoor, door_protocol
from .errors import error_body
from .session import Front, bearer_token


async def _refuse(send, status: int, kind: str, message: str) -> None:
    body = json.dumps(error_body(kind, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": body})


class ConcurrencyLimit:
    """ASGI middleware: at most `limit` HTTP requests in progress; the next gets 503 (OpenAI-style body)."""

    def __init__(self, app, limit: int, state: ServerState):
        self.app, self.limit, self.state, self.active = app, limit, state, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.active >= self.limit:
            self.state.count("http_errors_503")
            return await _refuse(send, 503, "busy", f"{self.active} requests are in progress, the server's limit "
                                                    "(http.max_concurrent); retry shortly")
        self.active += 1  # one event loop: no lock needed
        try:
            return await self.app(scope, receive, send)
        finally:
            self.active -= 1


class TenantLimit:
    """ASGI middleware: a tenant's HTTP requests in progress at once, at most its `connections` quota
    (each is a connection of its own in HTTP/1.1), so one tenant's slow or long requests cannot take
    every one of `http.max_concurrent` from the others; the next gets 429. A request without a valid
    token passes on to be answered 401 by the app.

    It also charges each request's CPU on the event loop (routing, replies; `_LoopCpu`) to its tenant
    (serve/rpc/gate.py `charge`). The gate paces a tenant's calls by their CPU, and an HTTP call's is
    the smaller part: on 2 cores, 32 connections asking GET /v1/models in a loop made 360 requests a
    second, twice what the same flood over RPyC was paced to, and another tenant's engine steps in
    its slowest tenth took 17 ms against 12."""

    def __init__(self, app, state: ServerState):
        self.app, self.state, self.active = app, state, {}

    async def __call__(self, scope, receive, send):
        tenant = self._tenant(scope) if scope["type"] == "http" else None
        if tenant is None:
            return await self.app(scope, receive, send)
        held = self.active.get(tenant.name, 0)
        if held >= tenant.quotas.connections:
            self.state.count("http_errors_tenant_concurrent")
            return await _refuse(send, 429, "too_many_requests",
                                 f"{held} requests of this tenant are in progress, its limit (its connections "
                                 "quota); retry when some finish")
        self.active[tenant.name] = held + 1  # one event loop: no lock needed
        done = []

        def release() -> None:
            if not done:
                done.append(True)
                left = self.active[tenant.name] - 1
                if left:
                    self.active[tenant.name] = left
                else:
                    del self.active[tenant.name]

        async def sending(message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()  # before its last bytes leave: the client may send its next request on seeing them
            await send(message)

        cpu = _LoopCpu(self.app(scope, receive, sending))
        try:
            return await cpu
        finally:
            GATE.charge(tenant.name, cpu.seconds)
            release()

    def _tenant(self, scope):
        registry = self.state.tenants
        if registry is None:  # one operator, no token check: nobody else to keep a share for
            return None
        value = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        token = bearer_token(value.decode("latin-1"))  # as Starlette decodes it for the app's own check
        return None if token is None else registry.identify(token)


class _LoopCpu:
    """Awaits a coroutine, adding up the CPU the event loop's thread spends running its steps (not the
    other tasks' steps in between, nor its worker threads', which the gate counts itself)."""

    def __init__(self, coro):
        self.coro, self.seconds = coro, 0.0

    def __await__(self):
        coro, value, error = self.coro, None, None
        while True:
            start = time.thread_time()
            try:
                step = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as done:  # returned (re-raised in a generator it would be a RuntimeError)
                self.seconds += time.thread_time() - start
                return done.value
            except BaseException:
                self.seconds += time.thread_time() - start
                raise
            self.seconds += time.thread_time() - start
            try:
                value, error = (yield step), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as e:  # thrown into the task (a cancellation): on to the coroutine
                value, error = None, e


class HttpServer:
    def __init__(self, state: ServerState, config: HttpConfig, base_model: str):
        import uvicorn

        from .app import create_app

        self.front = Front(state, base_model)
        app = ConcurrencyLimit(TenantLimit(create_app(self.front, config), state), config.max_concurrent, state)
        family = socket.getaddrinfo(config.host, config.port or 0, type=socket.SOCK_STREAM)[0][0]
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((config.host, config.port or 0))
        self._socket.listen(1024)
        self.host, self.port = config.host, self._socket.getsockname()[1]
        # h11 (the door's protocol is uvicorn's h11 one), not httptools: h11 refuses 16 KiB of headers
        # still incomplete, httptools (llhttp) read headers of any size. No access log: one line a request
        self.door = HttpDoor(config.max_pending, config.max_pending_per_address, config.first_byte_timeout_s,
                             config.header_timeout_s, config.keep_alive_s, state.count)
        # ws="none": no route takes WebSockets, so an upgrade request is answered as plain HTTP, and
        # the door's protocol is never swapped for another under it
        self._server = uvicorn.Server(uvicorn.Config(app, http=door_protocol(self.door), log_level="warning",
                                                     access_log=False, lifespan="off", ws="none",
                                                     timeout_keep_alive=int(max(1, config.keep_alive_s)),
                                                     # connections and tasks, a backstop: the JSON 503 is ConcurrencyLimit's
                                                     limit_concurrency=config.max_concurrent * 2 + 64,
                                                     server_header=False))
        self._thread: threading.Thread | None = None

    def start(self) -> "HttpServer":
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="vlora-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self._socket.close()

    def __enter__(self) -> "HttpServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
