"""A front-end process per tenant: after the token check, a tenant's connection is served by a process
of its own, so its calls take no turn at another tenant's interpreter.

Why: with the engine's step loop in a process of its own, one front end still ran every tenant's
connection threads on one interpreter. A tenant's 32 connections topping up one-token requests, or
only calling `poll` in a loop, made another tenant's requests 2.9-3.1x as slow on an H200, most of
it in submitting and in handing the answer back (results/soak/nvidia_h200/tenant_order). The gate
(serve/rpc/gate.py) paces the heaviest tenant but cannot make one interpreter run two threads at once.

How: the server's own process keeps the door (pending handshakes, the token check, connection
quotas) and hands each authenticated socket of a tenant (not the operator's) to that tenant's
process over a Unix socket (the descriptor itself, SCM_RIGHTS). The tenant process
(serve/rpc/tenant_front_end.py) attaches to the engine process over a link of its own
(serve/rpc/engine_links.py) and serves the connection with the same service, quotas and limits;
paced (rpc.pace_tenant_processes), its gate shares the clock with the other processes' tenants
(serve/rpc/shared_clock.py).
Its requests, queue and pixels are only its tenant's, so its per-tenant quotas hold there; the
server-wide decoded-pixel budget is one shared counter; the connection counts stay here (a
process tells when a connection it served ends). At most `rpc.tenant_processes` processes run; a
tenant past that is served in this process as before. A tenant process that dies takes only its
tenant's connections with it (the engine aborts their requests); the next connection starts a new
one. Tenants of the tenants file get their process when the server starts, others at their first
connection.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
from collections import Counter
from multiprocessing.reduction import send_handle

from .shared_clock import SharedClock
from .tenants import Tenant

log = logging.getLogger("vlora.serve.rpc")
IDS_PER_PROCESS = 10 ** 8  # connection ids of process k start at k * this: request ids stay unique
START_TIMEOUT_S = 120.0  # a process that has not said ready by then is killed (a new one starts later)


MOST_AUTO = 8  # `auto`'s number: one H200 machine's 16 cores served the soak's floods best with it
CORES_KEPT = 4  # the engine process, its torch threads and the door: unpaced processes leave them this many cores


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may run on (a container's limit included)
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_limit(value) -> int:
    """`rpc.tenant_processes` as a number (`auto`: MOST_AUTO), or ValueError naming the key.

    A process per tenant takes the tenants' calls off each other's interpreter: with 16 cores it took
    the soak's floods from 2.2-3.1x to 0.9-2.0x on an H200 (results/soak/*/tenant_processes). Where
    the cores are short they are paced (check_pacing), which on 2 cores beat one front end too
    (results/soak/cpu/paced_processes)."""
    if value == "auto":
        return MOST_AUTO
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"rpc.tenant_processes={value!r}: give the most tenants served by front-end processes of "
                         "their own (an integer >= 0, 0: every connection in the server's process; or auto: "
                         f"{MOST_AUTO})")
    return value


def check_pacing(value, limit: int, cores: int | None = None) -> bool:
    """`rpc.pace_tenant_processes` as a bool, or ValueError naming the key.

    `auto`: paced where the processes cannot each have a core beside CORES_KEPT. Unpaced on 2 cores, a
    flood's own process tripled its throughput and took the cores the engine steps on (the floods
    2.1-4.2x, results/soak/cpu/intervals); paced, the victim's p95 alone and loaded both fell
    (results/soak/cpu/paced_processes). On 16 cores, 8 unpaced processes are what the H200 runs measured."""
    if value == "auto":
        return limit > (usable_cores() if cores is None else cores) - CORES_KEPT
    if isinstance(value, bool):
        return value
    raise ValueError(f"rpc.pace_tenant_processes={value!r}: give true, false or auto (paced where the tenant "
                     f"processes outnumber the machine's cores less {CORES_KEPT})")


class _TenantProcess:
    """One tenant's process, as this one holds it: its control pipe and what it reported."""

    def __init__(self, name: str, process, conn, row: int = 0):
        self.name, self.process, self.conn, self.row = name, process, conn, row
        self.lock = threading.Lock()  # hand-offs from several connection threads go one at a time
        self.ready = threading.Event()
        self.connections = 0  # handed to it and not reported closed
        self.counters: dict = {}  # its server counters, as last reported

    @property
    def alive(self) -> bool:
        return self.process.is_alive()


class TenantProcesses:
    def __init__(self, state, attach: tuple, tenants_path: str, limit: int, settings: dict):
        """state: the server's ServerState (connection counts); attach: the engine's (address, key);
        settings: what a tenant process builds its server from (serve/rpc/tenant_front_end.py `run`)."""
        self.state, self.attach, self.tenants_path, self.limit = state, attach, tenants_path, limit
        self.settings = settings
        ctx = multiprocessing.get_context("spawn")  # never fork a process that has threads
        self._ctx = ctx
        self.pixel_pool = ctx.Value("q", 0)
        # row 0: the server's own process; rows 1..limit: the live tenant processes
        self.clock = SharedClock(limit + 1) if settings["limits"].pace_tenant_processes else None
        self._procs: dict[str, _TenantProcess] = {}
        self._lock = threading.Lock()
        self._started = 0
        self._closed = False
        self.counters: Counter = Counter()  # processes started, died, hand-offs

    def start_for(self, names) -> None:
        """Starts the processes of these tenants now (up to the limit), without waiting for them."""
        for name in names:
            with self._lock:
                self._process_for(name)

    # ---- the hand-off --------------------------------------------------------------------------
    def hand_off(self, sock, tenant) -> bool:
        """Passes an authenticated socket to its tenant's process; False: serve it here (the operator,
        a tenant past the limit, or a process that cannot take it)."""
        if not isinstance(tenant, Tenant) or tenant.operator or self._closed:
            return False
        with self._lock:
            proc = self._process_for(tenant.name)
        if proc is None or not proc.ready.wait(START_TIMEOUT_S) or not proc.alive:
            return False
        try:
            peer = sock.getpeername()
        except OSError:
            return False
        # counted before the process has the socket: the client's handshake with it may end before this
        # thread runs again, and its next connection must find this one counted
        self.state.connected(tenant)
        with proc.lock:
            try:
                proc.conn.send_bytes(pickle.dumps(("socket", tenant, peer)))
                send_handle(proc.conn, sock.fileno(), proc.process.pid)
            except OSError as e:
                self.state.disconnected(tenant)
                log.warning("tenant process of %s: a connection could not be handed over (%s)", tenant.name, e)
                return False
            proc.connections += 1
        self.counters["handed_off"] += 1
        return True

    def _process_for(self, name: str) -> _TenantProcess | None:
        """The live process of tenant `name`, started if need be; None past the limit (under self._lock)."""
        proc = self._procs.get(name)
        if proc is not None and proc.alive:
            return proc
        if proc is None and sum(p.alive for p in self._procs.values()) >= self.limit:
            return None
        self._started += 1
        index = self._started
        taken = {p.row for p in self._procs.values() if p.alive}
        row = min(set(range(1, self.limit + 1)) - taken)  # a dead process's row goes to the next one
        parent, child = self._ctx.Pipe(duplex=True)
        from .tenant_front_end import run

        level = logging.getLogger("vlora").getEffectiveLevel()
        process = self._ctx.Process(target=run, name=f"vlora-tenant-{name}",
                                    args=(child, name, self.attach, self.tenants_path, self.settings,
                                          index * IDS_PER_PROCESS, self.pixel_pool, level, self.clock, row),
                                    daemon=True)
        process.start()
        child.close()
        proc = _TenantProcess(name, process, parent, row)
        self._procs[name] = proc
        self.counters["tenant_processes_started"] += 1
        threading.Thread(target=self._listen, args=(proc,), name=f"vlora-tenant-{name}-reports", daemon=True).start()
        return proc

    # ---- what a process reports ------------------------------------------------------------------
    def _listen(self, proc: _TenantProcess) -> None:
        while True:
            try:
                message = pickle.loads(proc.conn.recv_bytes())
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "ready":
                proc.ready.set()
            elif kind == "closed":
                with proc.lock:
                    proc.connections -= 1
                self.state.disconnected(message[1])
            elif kind == "counters":
                proc.counters = message[1]
        self._gone(proc)

    def _gone(self, proc: _TenantProcess) -> None:
        """Its pipe closed: it stopped or died. Its connections are gone with it."""
        proc.process.join(2)
        proc.ready.set()  # no hand-off waits for it any longer
        with proc.lock:
            lost, proc.connections = proc.connections, 0
        for _ in range(lost):  # the counts are kept by tenant name
            self.state.disconnected(Tenant(proc.name, "tenant", ""))
        if not self._closed:
            self.counters["tenant_processes_died"] += 1
            log.error("the front-end process of tenant %s exited (exit code %s) with %d connection(s); "
                      "its next connection starts a new one", proc.name, proc.process.exitcode, lost)

    def server_counters(self) -> Counter:
        """The tenant processes' own server counters, summed, and this manager's."""
        total = Counter(self.counters)
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            total.update({k: v for k, v in proc.counters.items() if isinstance(v, int)})
        total["tenant_processes"] = sum(p.alive for p in procs)
        return total

    def tenant_gates(self, own: dict[str, dict]) -> dict[str, dict]:
        """tenant -> its gate counters in the processes that served it, as they last reported, added to
        `own` (the server's process's)."""
        with self._lock:
            procs = list(self._procs.values())
        out = {t: Counter(c) for t, c in own.items()}
        for proc in procs:
            for tenant, counts in (proc.counters.get("tenant_gates") or {}).items():
                out.setdefault(tenant, Counter()).update(counts)
        return {t: dict(c) for t, c in out.items()}

    def pids(self) -> dict[str, int]:
        """tenant -> the pid of its live process (the operator's metrics)."""
        with self._lock:
            return {name: p.process.pid for name, p in self._procs.items() if p.alive}

    def close(self) -> None:
        self._closed = True
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            try:
                with proc.lock:
                    proc.conn.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
        for proc in procs:
            proc.process.join(5)
            if proc.process.is_alive():
                proc.process.kill()
                proc.process.join(5)
            proc.conn.close()
