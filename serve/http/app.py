"""The OpenAI-compatible routes (Starlette): chat and text completions, models, health, metrics.

Every route but /health needs `Authorization: Bearer <token>`, the tenant's RPyC token. The work
that blocks or takes CPU (parsing bodies, reading pictures, submitting, waiting for events) runs on
worker threads inside the tenant's turn at the interpreter (serve.rpc.gate), never on the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from serve.rpc.tenants import Quotas, Tenant

from .bodies import parse_chat, parse_completion, read_json
from .config import HttpConfig
from .errors import HttpError, error_body
from .responses import Choice, chunk, new_id, sse, usage, whole
from .session import Front, Session

log = logging.getLogger("vlora.serve.http")
POLL_S = 1.0  # one wait for events; between waits a client that went away is noticed
ANONYMOUS = Tenant("anonymous", "tenant", "", Quotas())


def create_app(front: Front, config: HttpConfig) -> Starlette:
    limits = front.state.limits
    body_limit = config.body_limit(limits.max_message_bytes)
    threads = anyio.CapacityLimiter(config.max_concurrent + 8)
    incidents = itertools.count()

    async def run(fn, *args):
        return await anyio.to_thread.run_sync(fn, *args, limiter=threads)

    async def read_body(request: Request) -> bytes:
        """The body, refused past its size as it arrives (413) or when it comes too slowly (408)."""
        if request.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
            raise HttpError("unsupported_media", "bodies are taken uncompressed (no Content-Encoding)")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > body_limit):
            raise HttpError("too_large", f"the body is over the server's limit of {body_limit} bytes (http.max_body_bytes)")
        deadline = time.monotonic() + config.body_timeout_s
        parts, size = [], 0
        pieces = request.stream().__aiter__()
        while True:
            try:
                piece = await asyncio.wait_for(pieces.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                return b"".join(parts)
            except asyncio.TimeoutError:
                front.state.count("http_body_timeouts")
                raise HttpError("timeout", f"the body did not arrive within {config.body_timeout_s:g} s "
                                           "(http.body_timeout_s)") from None
            size += len(piece)
            if size > body_limit:
                raise HttpError("too_large", f"the body is over the server's limit of {body_limit} bytes "
                                             "(http.max_body_bytes)")
            parts.append(piece)

    def tenant_of(request: Request) -> Tenant:
        tenant = front.tenant(request.headers.get("authorization"), request.client.host if request.client else "?")
        request.state.tenant = tenant  # its connection, kept alive, then waits among the tenant's (door.py)
        return tenant

    def prepare(session: Session, body: bytes, chat: bool):
        with session.turn():
            parse = parse_chat if chat else parse_completion
            job = parse(read_json(body), limits, config, front.base_model, session.check_model)
            session.submit(job)
            return job

    async def complete(request: Request, chat: bool):
        tenant = tenant_of(request)  # before the body is read
        body = await read_body(request)
        session = front.session(tenant)
        job = await run(prepare, session, body, chat)
        front.state.count("http_chat_completions" if chat else "http_completions")
        choices = [Choice(i, job.stop) for i in range(job.n)]
        rid = new_id("chatcmpl" if chat else "cmpl")
        if job.stream:
            return StreamingResponse(stream(session, job, choices, rid, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        tasks = [asyncio.ensure_future(follow(session, r, c, request)) for r, c in zip(session.ids, choices)]
        try:
            await asyncio.gather(*tasks)
        finally:  # one choice failed (or the client left): the others stop waiting, and the engine stops too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not all(c.done for c in choices):
                with anyio.CancelScope(shield=True):
                    await run(session.abort)
        return JSONResponse(whole(chat, rid, job.model, choices, job.head))

    async def follow(session: Session, request_id: str, choice: Choice, request: Request | None = None, out=None):
        """Waits for one choice's events until it is done; `out(text, first)` gets its text as it comes."""
        first = True
        while not choice.done:
            for event in await run(session.poll, request_id, POLL_S):
                text = choice.take(event)
                if out is not None and (text or first or choice.done):
                    await out(text, first, choice.done)
                    first = False
                if choice.stopped:  # its text ends here: the engine need not go on
                    await run(session.abort, [request_id])
                if choice.done:
                    break
            if request is not None and not choice.done and await request.is_disconnected():
                raise HttpError("timeout", "the client went away")

    async def stream(session: Session, job, choices: list[Choice], rid: str, chat: bool):
        created, queue = int(time.time()), asyncio.Queue()
        request_path = "/v1/chat/completions" if chat else "/v1/completions"

        async def pump(request_id: str, choice: Choice):
            async def out(text: str, first: bool, done: bool = False):
                finish = choice.finish_reason if done else None
                await queue.put(sse(chunk(chat, rid, job.model, created, choice.index, text, finish, first,
                                          choice.head if done and job.head else None)))
            try:
                await follow(session, request_id, choice, out=out)
            except HttpError as e:  # the status is sent already: the error comes as an event, as OpenAI's do
                await queue.put(sse(e.body()))
            except Exception as e:
                await queue.put(sse(error_body("internal", failure(request_path, e))))
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(r, c)) for r, c in zip(session.ids, choices)]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                else:
                    yield item
            if job.include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "created": created, "model": job.model, "choices": [], "usage": usage(choices)})
            yield sse("[DONE]")
        finally:
            for task in tasks:
                task.cancel()
            if not all(c.done for c in choices):  # the client went away: its requests free the engine
                with anyio.CancelScope(shield=True):
                    await run(session.abort)

    async def chat_route(request: Request):
        return await complete(request, chat=True)

    async def completions_route(request: Request):
        return await complete(request, chat=False)

    async def models(request: Request):
        session = front.session(tenant_of(request))
        adapters = (await run(session.call, "list_adapters"))["adapters"]
        created = int(front.state.started)
        data = [{"id": front.base_model, "object": "model", "created": created, "owned_by": "vlora"}]
        for a in adapters:
            extra = {k: v for k, v in a.items() if k not in ("name", "owner")}
            data.append({"id": a["name"], "object": "model", "created": created, "owned_by": a["owner"],
                         "parent": front.base_model, "vlora": extra})
        if "model_id" in request.path_params:
            found = [m for m in data if m["id"] == request.path_params["model_id"]]
            if not found:
                raise HttpError("unknown_adapter", "no such model is available to this key", "model")
            return JSONResponse(found[0])
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request):
        tenant = tenant_of(request) if request.headers.get("authorization") else None
        reply = await run(Session(front.state, tenant or ANONYMOUS).call, "health")
        status = 200 if reply["healthy"] else 503
        if tenant is None:  # without a token: up or not, and nothing of the load
            reply = {k: reply[k] for k in ("healthy", "reason") if k in reply}
        reply.pop("ok", None)
        return JSONResponse(reply, status)

    async def metrics(request: Request):
        session = front.session(tenant_of(request))
        text = (await run(session.call, "metrics", "prometheus"))["text"]
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def refused(request: Request, exc: HttpError):
        front.state.count(f"http_errors_{exc.status}")
        headers = {"Connection": "close"} if exc.status in (408, 413, 415) else None
        return JSONResponse(exc.body(), exc.status, headers)

    async def starlette_error(request: Request, exc: HTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_argument")
        message = {404: f"no route {request.url.path[:100]!r}; the API is under /v1 (docs/http.md)",
                   405: f"{request.method} is not taken by {request.url.path[:100]!r}"}.get(exc.status_code, "bad request")
        return JSONResponse(error_body(kind, message), exc.status_code)

    def failure(path: str, exc: Exception) -> str:
        """Logs an internal error with an incident id; returns what the client is told (never the error itself)."""
        incident = f"h{next(incidents)}"
        log.error("internal error %s on %s: %s: %s", incident, path[:100], type(exc).__name__, str(exc)[:200],
                  exc_info=exc)
        front.state.count("errors_internal")
        return f"the server failed on this request (incident {incident}, in its log)"

    async def failed(request: Request, exc: Exception):
        return JSONResponse(error_body("internal", failure(request.url.path, exc)), 500)

    routes = [Route("/v1/chat/completions", chat_route, methods=["POST"]),
              Route("/v1/completions", completions_route, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/v1/models/{model_id:path}", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HttpError: refused, HTTPException: starlette_error,
                                                         Exception: failed})
