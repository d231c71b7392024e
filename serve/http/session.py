"""The HTTP side's door to the server: the RPyC service's own methods, for one request at a time.

Each HTTP request is served by a fresh `VLoRAService` acting for the bearer token's tenant, exactly
as an RPyC connection is: its exposed methods validate the request (serve.rpc.wire), take the
tenant's queue slot and pixel budget (serve.rpc.state), resolve the adapter it may use
(serve.rpc.ownership), decode frames and submit to the engine loop or process, and answer one JSON
reply whose errors are already the clipped, internals-free kinds of serve.rpc.replies. Nothing of
the validation or quotas is copied here. An HTTP request is not a connection: it holds no connection
slot; the tenant's `queued` quota and the server's pixel budget bound what it holds.
"""

from __future__ import annotations

import json

from serve.rpc import ownership
from serve.rpc.auth import RefusalLog
from serve.rpc.gate import GATE
from serve.rpc.service import VLoRAService
from serve.rpc.state import ServerState
from serve.rpc.tenants import Tenant, sole_operator
from serve.rpc.wire import RequestError

from .bodies import Job
from .errors import HttpError, from_reply

MAX_TOKEN_CHARS = 1000  # what a tenants file's token may be (serve.rpc.tenants.check_token)


def bearer_token(authorization: str | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header value, as the registry takes it; None
    when there is none or it is longer than any token may be."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_CHARS:
        return None
    return token.encode("utf-8", "replace")


class Front:
    """What every HTTP request shares: the server's state (the RPyC server's own, when both run)."""

    def __init__(self, state: ServerState, base_model: str, refusals: RefusalLog | None = None):
        self.state, self.base_model = state, base_model
        self.refusals = refusals or RefusalLog()

    def tenant(self, authorization: str | None, peer: str) -> Tenant:
        """The tenant whose token the `Authorization: Bearer <token>` header carries, else 401."""
        registry = self.state.tenants
        if registry is None:  # a server built without the token check: one operator
            return sole_operator()
        token = bearer_token(authorization)
        if token is None:
            self.state.count("http_refused_no_token")
            self.refusals.refused(peer, "HTTP request without a bearer token")
            raise HttpError("unauthorized", "send the tenant's token as `Authorization: Bearer <token>`")
        tenant = registry.identify(token)
        if tenant is None:
            self.state.count("http_refused_token")
            self.refusals.refused(peer, "HTTP request with a wrong token")
            raise HttpError("unauthorized", "the token is not valid on this server")
        return tenant

    def session(self, tenant: Tenant) -> "Session":
        return Session(self.state, tenant)


class Session:
    """One HTTP request's service: calls run on a worker thread (they block on the engine)."""

    def __init__(self, state: ServerState, tenant: Tenant):
        self.state, self.tenant = state, tenant
        self.service = VLoRAService(state)
        self.service.tenant = tenant  # what on_connect sets for a connection; no connection is counted
        self.ids: list[str] = []

    def call(self, method: str, *args) -> dict:
        reply = json.loads(getattr(self.service, f"exposed_{method}")(*args))
        if not reply["ok"]:
            raise from_reply(reply)
        return reply

    def turn(self):
        """This request's turn at the interpreter, as a connection's (serve.rpc.gate): tenants by weight."""
        return GATE.call(self.service.conn_id, self.tenant.name, self.tenant.weight)

    def check_model(self, job: Job) -> None:
        """The adapter the request names is one this tenant may use: answered before its pictures are read."""
        if job.adapter is None:
            return
        try:
            self.state.with_adapters(lambda loaded: ownership.resolve(self.tenant, job.adapter, loaded))
        except RequestError as e:
            if e.kind != "unknown_adapter":  # the engine could not be asked (warming, gone): that, not a 404
                raise HttpError(e.kind, str(e)) from None
            raise HttpError("unknown_adapter", f"no model {job.adapter!r} is available to this key: GET /v1/models "
                                               "lists the base model and the adapters it may use", "model") from None

    def submit(self, job: Job) -> list[str]:
        """Submits the job's n requests; returns their ids (on a refusal, those submitted are aborted)."""
        method = "submit_image" if job.kind == "image" else "submit_video"
        blobs = tuple(job.blobs)
        try:
            for i in range(job.n):
                self.ids.append(self.call(method, job.spec_json(i), blobs)["request_id"])
        except BaseException:
            self.abort()
            raise
        return list(self.ids)

    def poll(self, request_id: str, timeout_s: float) -> list[dict]:
        return self.call("poll", request_id, timeout_s)["events"]

    def abort(self, ids: list[str] | None = None) -> None:
        """Aborts this request's unfinished engine requests (the client went away, or a stop string matched)."""
        for request_id in self.ids if ids is None else ids:  # one already collected answers unknown_request: nothing to do
            if json.loads(self.service.exposed_abort(request_id))["ok"]:
                self.state.count("http_aborted")
