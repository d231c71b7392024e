"""The RPyC server around one engine: restricted protocol, token authentication, limits.

    server = RpcServer(engine, token="...", port=0).start()   # a background thread
    print(server.port); ...; server.close()

RPyC runs in its restricted mode: only `exposed_` methods of the service are reachable, no
public-attribute access, no pickling, no custom exception classes and no server tracebacks in
replies. Classic mode (remote `eval`, module access) is never offered.
"""

from __future__ import annotations

import logging
import threading

from rpyc.utils.helpers import classpartial

from . import gate
from .auth import TokenAuthenticator
from .guarded import GuardedServer
from .logs import bound
from .engine_process import EngineProcess
from .loop import EngineLoop
from .memory import freeze_heap, pin_unless_forwarding, trim_when_idle
from .service import VLoRAService
from .state import ServerState
from .tenants import TenantRegistry
from .wire import Limits

PROTOCOL_CONFIG = {
    "allow_public_attrs": False,
    "allow_safe_attrs": False,  # RPyC's "safe" dunders (__doc__, __repr__, __new__...); serve.rpc.sealed refuses them too
    "allow_all_attrs": False,
    "allow_setattr": False,
    "allow_delattr": False,
    "allow_pickle": False,
    "allow_exposed_attrs": True,
    "exposed_prefix": "exposed_",
    "import_custom_exceptions": False,
    "instantiate_custom_exceptions": False,
    "instantiate_oldstyle_exceptions": False,
    "include_local_traceback": False,
    "include_local_version": False,
    "propagate_SystemExit_locally": False,
    "sync_request_timeout": 120,
}


def _quiet_logger() -> logging.Logger:
    """RPyC logs every connect and goodbye at INFO; keep warnings and errors only."""
    logger = logging.getLogger("vlora.serve.rpc.server")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)
    return logger


def _bounded_logs(server_logger: logging.Logger) -> None:
    bound(logging.getLogger("vlora.serve.rpc"), server_logger)


MESSAGE_SLACK = 1 << 20  # beyond the frames' bytes: the JSON spec and RPyC's own framing


class RpcServer:
    def __init__(self, engine, token, host: str = "127.0.0.1", port: int = 0, limits: Limits | None = None,
                 max_connections: int = 64, logger: logging.Logger | None = None, freeze: bool = False,
                 tenant_processes: int = 0):
        """engine: an engine object (its step loop runs on a thread of this process) or an EngineProcess
        (the engine in a process of its own); token: one token (its holder is the operator) or a
        TenantRegistry (serve.rpc.tenants). freeze: before it listens, the process's heap is exempted
        from the collector's full walks (memory.freeze_heap; `vlora serve`: a process that serves one
        server for its life). tenant_processes: at most this many tenants (of a tenants file) are served
        by front-end processes of their own (serve.rpc.tenant_processes; the engine must be an
        EngineProcess started attachable); 0: every connection is served here."""
        limits = limits or Limits()
        pin_unless_forwarding(engine)  # frames and requests of megabytes go back to the system when freed (serve.rpc.memory)
        tenants = token if isinstance(token, TenantRegistry) else TenantRegistry.single(token)
        self.loop = engine if isinstance(engine, EngineProcess) else EngineLoop(engine)
        self.state = ServerState(self.loop, limits, max_connections, tenants)
        self._server = GuardedServer(classpartial(VLoRAService, self.state), hostname=host, port=port,
                                     authenticator=TokenAuthenticator(tenants, self.state.admit,
                                                                      limits.handshake_timeout_s),
                                     protocol_config=dict(PROTOCOL_CONFIG), logger=logger or _quiet_logger(),
                                     max_handshakes=limits.max_handshakes or max_connections,
                                     max_handshakes_per_address=limits.max_handshakes_per_address,
                                     first_byte_timeout_s=limits.first_byte_timeout_s,
                                     handshake_timeout_s=limits.handshake_timeout_s, idle_timeout_s=limits.idle_timeout_s,
                                     max_message_bytes=limits.max_message_bytes + MESSAGE_SLACK)
        _bounded_logs(self._server.logger)
        gate.configure(limits.gate_slots, limits.gate_share)  # process-wide: the interpreter is one
        guarded = self._server
        self.tenant_processes = self._tenant_processes(tenant_processes, tenants, limits, max_connections)

        def door_counters() -> dict:
            out = {**guarded.door.counters, "accept_errors": guarded.accept_errors, "idle_closed": guarded.idle_closed}
            if self.tenant_processes is not None:  # their own counters, summed (idle closes added)
                for key, value in self.tenant_processes.server_counters().items():
                    out[key] = out.get(key, 0) + value
            return out

        self.state.door_counters = door_counters

        if self.tenant_processes is not None:  # this process's gate counts and theirs, added by tenant
            self.state.tenant_gates = lambda: self.tenant_processes.tenant_gates(gate.GATE.tenant_metrics())
        self.host, self.port = host, self._server.port
        self._thread: threading.Thread | None = None
        self._trimmer = None
        self._freeze, self.frozen_objects = freeze, 0

    def _tenant_processes(self, limit: int, tenants: TenantRegistry, limits: Limits, max_connections: int):
        from .tenant_processes import TenantProcesses, check_limit

        limit = check_limit(limit)
        attach = getattr(self.loop, "attach_address", None)
        if limit == 0 or tenants.path is None or attach is None:  # one token, or the engine on a thread here
            return None
        settings = {"limits": limits, "max_connections": max_connections, "protocol_config": dict(PROTOCOL_CONFIG),
                    "max_message_bytes": limits.max_message_bytes + MESSAGE_SLACK}
        manager = TenantProcesses(self.state, attach, str(tenants.path), limit, settings)
        self.state.pixel_pool = manager.pixel_pool
        if manager.clock is not None:  # this process's tenants (the operator, those past the limit): row 0
            gate.GATE.share_clock(manager.clock, 0)
        self._server.hand_off = manager.hand_off
        return manager

    def start(self) -> "RpcServer":
        """Serve from a background thread (tests, the load test); see serve_forever for the command."""
        self.loop.start()
        self._before_serving()
        # listen before returning, so a client may connect at once (start() skips an active listener)
        self._server._listen()
        self._thread = threading.Thread(target=self._server.start, name="vlora-rpc", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self, ready=None) -> None:
        """Serve on this thread until close(); `ready()` is called once connections are accepted."""
        self.loop.start()
        self._before_serving()
        self._server._listen()
        if ready is not None:
            ready()
        try:
            self._server.start()  # returns after close()
        finally:
            self.loop.stop()

    def _before_serving(self) -> None:
        if self._freeze and not self.frozen_objects:  # the heap as it serves, before the first client
            self.frozen_objects = self.state.counters["heap_frozen_objects"] = freeze_heap()
        state = self.state  # once no frames are held, the memory a burst of requests freed goes back
        self._trimmer = self._trimmer or trim_when_idle(lambda: state.pixels_in_flight == 0)
        if self.tenant_processes is not None:  # the tenants known now get their processes before they connect
            self.tenant_processes.start_for(t.name for t in state.tenants.members() if not t.operator)

    def close(self) -> None:
        if self._trimmer is not None:
            self._trimmer.set()
        self._server.close()
        if self.tenant_processes is not None:
            self.tenant_processes.close()
        self.loop.stop()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> "RpcServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
