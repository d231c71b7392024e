"""RPyC transport: a restricted, token-authenticated service over one engine, and its client.

    server = RpcServer(engine, token, host="127.0.0.1", port=18861).start()
    with Client("127.0.0.1", 18861, token) as client:
        print(client.submit_image("How many cars?", [frame]).result()["text"])

`wire` defines what crosses the connection (a JSON spec plus bytes blobs; never references)
and validates it; `loop` is the engine's thread; `service` the exposed methods; `auth` the
token handshake; `tenants` who holds which token, with which role and quotas; `ownership` which
adapters each tenant sees and may unload; `metrics` the Prometheus text export. The face is lazy: the client side
(`client`, `auth`, `wire`) imports without torch, so applications load no engine.
"""

from serve.lazy import lazy_face

_EXPORTS = {
    "AuthError": ".auth",
    "TokenAuthenticator": ".auth",
    "Client": ".client",
    "ServerError": ".client",
    "Stream": ".client",
    "EngineProcess": ".engine_process",
    "EngineLoop": ".loop",
    "Ticket": ".loop",
    "PROTOCOL_CONFIG": ".server",
    "RpcServer": ".server",
    "ServerState": ".state",
    "Quotas": ".tenants",
    "Tenant": ".tenants",
    "TenantRegistry": ".tenants",
    "add_tenant": ".tenants",
    "VLoRAService": ".service",
    "Limits": ".wire",
    "RequestError": ".wire",
    "Submission": ".wire",
    "decode_frame": ".wire",
    "encode_frame": ".wire",
    "parse_submission": ".wire",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
