"""HTTP transport: an OpenAI-compatible API beside the RPyC service, over the same service layer.

    http = HttpServer(rpc_server.state, HttpConfig(port=8000), base_model="qwen2_vl_tiny").start()

`POST /v1/chat/completions` and `/v1/completions` (streaming by server-sent events), `GET /v1/models`,
`/health`, `/metrics`; the bearer token is the tenant's RPyC token (docs/http.md). `session` calls
the RPyC service's own methods per request (validation, quotas, adapters, frame decoding,
submission), `bodies` and `media` turn OpenAI bodies into the wire's request spec and frames,
`responses` builds OpenAI's objects, `app` the routes, `server` runs uvicorn on a thread, with
`door` bounding the connections that have no request in progress.
`config` imports without Starlette or uvicorn (`missing_packages` says what to install).
"""

from serve.lazy import lazy_face

_EXPORTS = {
    "HttpConfig": ".config",
    "missing_packages": ".config",
    "HttpError": ".errors",
    "HttpServer": ".server",
    "create_app": ".app",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
