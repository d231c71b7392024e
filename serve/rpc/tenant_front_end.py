"""A tenant's front-end process (serve/rpc/tenant_processes.py starts it): serves the connections the
server hands it, with the same service, limits and quotas, over a link of its own to the engine
process (serve/rpc/engine_links.py).

Control pipe, server -> here: ("socket", tenant, peer) followed by the socket's descriptor, and
("stop",). Here -> server: ("ready",) once attached, ("closed", tenant) when a connection ends, and
("counters", {...}) about once a second while they change. The process ends with its pipe: a
server that exits or is killed takes it along.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
import time
from multiprocessing.reduction import recv_handle

COUNTERS_EVERY_S = 1.0


def run(conn, name: str, attach: tuple, tenants_path: str, settings: dict, first_id: int, pixel_pool,
        log_level: int, clock=None, row: int = 0) -> None:
    """The process's entry. settings: {"limits": Limits, "max_connections": int, "protocol_config": dict};
    clock: the server's SharedClock when the tenant processes are paced (this process's row: `row`)."""
    import itertools

    from rpyc.utils.helpers import classpartial

    from . import gate
    from .connections import ConnectionRunner
    from .engine_process import EngineProcess
    from .logs import clip
    from .memory import freeze_heap, pin_mmap_threshold, trim_when_idle
    from .server import _bounded_logs, _quiet_logger
    from .service import VLoRAService
    from .state import ServerState
    from .tenants import TenantRegistry

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("vlora.serve.rpc")
    pin_mmap_threshold()
    send_lock = threading.Lock()

    def tell(message: tuple) -> None:
        with send_lock:
            try:
                conn.send_bytes(pickle.dumps(message))
            except OSError:
                pass

    limits = settings["limits"]
    if limits.tenant_process_nice:  # yields the cores to the engine process (and the door) when they are short
        os.nice(limits.tenant_process_nice)
    try:
        loop = EngineProcess.attach(*attach)
    except (OSError, RuntimeError, EOFError) as e:
        log.error("tenant process of %s: cannot attach to the engine (%s)", name, e)
        return
    state = ServerState(loop, limits, settings["max_connections"], TenantRegistry.from_file(tenants_path),
                        ids=itertools.count(first_id), pixel_pool=pixel_pool)
    if clock is not None:  # paced against the tenants of every front end (serve/rpc/shared_clock.py)
        gate.configure(limits.gate_slots, limits.gate_share)
        gate.GATE.share_clock(clock, row)
    else:  # one tenant's connections only: they take turns (gate_slots) without pacing against anyone
        gate.configure(limits.gate_slots, 1.0)
    logger = _quiet_logger()
    _bounded_logs(logger)
    runner = ConnectionRunner(classpartial(VLoRAService, state), settings["protocol_config"], logger,
                              settings["max_message_bytes"], limits.idle_timeout_s)
    freeze_heap()  # as the server's own process: no full collection walks start-up's heap
    trim_when_idle(lambda: state.pixels_in_flight == 0)

    def serve(sock: socket.socket, tenant) -> None:
        try:
            runner.serve(sock, tenant)
        except Exception as e:  # a client's malformed protocol: one clipped line
            runner.warn(f"connection ended: {clip(f'{type(e).__name__}: {e}')}")
        finally:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
            tell(("closed", tenant))

    def report() -> None:
        sent = None
        while True:
            time.sleep(COUNTERS_EVERY_S)
            with state.lock:
                now = dict(state.counters, idle_closed=runner.idle_closed, **gate.GATE.metrics(),
                           tenant_gates=gate.GATE.tenant_metrics())
            if now != sent:
                tell(("counters", now))
                sent = now

    threading.Thread(target=report, name="vlora-tenant-counters", daemon=True).start()
    tell(("ready",))
    try:
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the server is gone: so is this process
                break
            if message[0] == "stop":
                break
            _, tenant, _peer = message
            fd = recv_handle(conn)
            sock = socket.socket(fileno=fd)
            threading.Thread(target=serve, args=(sock, tenant), name="vlora-tenant-connection", daemon=True).start()
    finally:
        loop.stop()
        os._exit(0)  # connection threads are daemons: their sockets close with the process
