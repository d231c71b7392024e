"""RPyC transport: a restricted, token-authenticated service over one engine, and its client.

    server = RpcServer(engine, token, host="127.0.0.1", port=18861).start()
    with Client("127.0.0.1", 18861, token) as client:
        print(client.submit_image("How many cars?", [frame]).result()["text"])

`wire` defines what crosses the connection (a JSON spec plus bytes blobs; never references)
and validates it; `loop` is the engine's thread; `service` the exposed methods; `auth` the
token handshake; `metrics` the Prometheus text export.
"""

from .auth import AuthError, TokenAuthenticator
from .client import Client, ServerError, Stream
from .loop import EngineLoop, Ticket
from .server import PROTOCOL_CONFIG, RpcServer
from .service import ServerState, VLoRAService
from .wire import Limits, RequestError, Submission, decode_frame, encode_frame, parse_submission

__all__ = [
    "RpcServer", "PROTOCOL_CONFIG", "Client", "Stream", "ServerError", "AuthError", "TokenAuthenticator",
    "EngineLoop", "Ticket", "ServerState", "VLoRAService",
    "Limits", "RequestError", "Submission", "parse_submission", "decode_frame", "encode_frame",
]
