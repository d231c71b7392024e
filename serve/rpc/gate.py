"""The connection threads' turns at the interpreter, so that no client's calls can slow another's.

Every RPC call runs on its connection's thread. With the engine's step loop on one more thread of
the same process (rpc.engine_process=false, tensor parallel, replicas), CPython runs one thread's
bytecode at a time, so 32 connections calling `poll` in a loop left the engine thread a sliver of
the interpreter and a victim's request slowed 10-20 fold with no engine work queued at all; `vlora
serve` runs the step loop in a process of its own for that (serve/rpc/engine_process.py), and the
connection threads still share the front end's interpreter with each other. A shorter interpreter
switch interval does not help (every runnable thread still takes its turn; results/fairness).
The gate bounds the connection threads:

- **slots**: at most `slots` threads run service code at once; the others wait asleep (a thread
  blocked on a lock costs the interpreter nothing);
- **share**: together they use at most `share` of the wall clock (their CPU time inside the gate,
  plus `overhead_s` per call for the protocol work around it), each tenant busy now its part by
  weight; a tenant past its part waits, asleep and holding no slot, before its next call queues,
  while the engine thread (and the other tenants) run: a flood pays for its own calls. Only the
  tenant using the most of the clock for its weight (its calls' CPU, decayed over a second) is
  paced: a victim is never held back while another tenant uses more;
- **fair order**: waiting calls go in by start-time fair queueing over tenants (a tenant's turns
  follow its weight), and over the connections of a tenant, one call per turn: a tenant whose
  32 connections call in a loop gets as many turns as another tenant's one connection, so a flood
  slows the flooding tenant, not the others.

With a front-end process per tenant paced against the others (rpc.pace_tenant_processes), the share
is split, and the heaviest found, among the tenants calling in every front-end process
(serve/rpc/shared_clock.py).

A blocking wait inside a call (poll's wait for events, a call run on the engine thread) must not
hold a slot: wrap it in `with GATE.released(): ...`; a call waiting while every slot has been
held STUCK_S goes in anyway, so a wait left inside stalls the others briefly, never for long.
`guarded` (serve/rpc/replies.py) enters the gate around every exposed method; entered around
RPyC's message dispatch as well, it also covers the protocol's own work (unboxing, replies, calls
of names that are not exposed), which measured best (results/fairness/cpu). Entering is
reentrant: a nested enter on the same thread is one turn. `configure` sets the limits.
"""

from __future__ import annotations

import heapq
import math
import itertools
import threading
import time
from collections import Counter
from contextlib import contextmanager

from .shared_clock import BUSY_S  # a tenant calls now if it called within this; a process's row too

MAX_REMEMBERED = 4096  # tenants / connections whose virtual time is kept (the idle ones are forgotten)
# a call waiting while every slot has been held this long goes in anyway: a blocking wait left
# inside a call (not wrapped in released()) or a very long call stalls the others at most this long
STUCK_S = 0.05
USE_TAU_S = 1.0  # a tenant's use of the clock is its calls' CPU time, decayed with this time constant


class _Ticket(threading.Event):
    gone = False  # went in over the limit (the slots were stuck): the hand-off skips it


class Gate:
    def __init__(self, slots: int = 1, share: float = 0.5, overhead_s: float = 100e-6, burst_s: float = 0.02):
        self._check(slots, share, overhead_s, burst_s)
        self.slots, self.share, self.overhead_s, self.burst_s = slots, share, overhead_s, burst_s
        self._lock = threading.Lock()
        self._free = slots
        self._queues: dict = {}  # tenant -> heap of (connection's virtual start, arrival, Event)
        self._arrival = itertools.count()
        self._tenant_v: dict = {}  # tenant -> virtual time of its next turn
        self._conn_v: dict = {}  # connection -> its virtual time among its tenant's connections
        self._now_v = 0.0  # virtual time of the latest turn given: an idle tenant comes back at it
        self._budget: dict = {}  # tenant -> [seconds it may still use before it paces, refilled at, weight]
        self._busy: dict = {}  # tenant -> (last call's time, weight): the tenants sharing the clock now
        self._use: dict = {}  # tenant -> [CPU seconds of its calls, decayed over USE_TAU_S, at time]
        self._pacers: dict = {}  # tenant -> the lock its threads take turns pacing under
        self._local = threading.local()  # per thread: depth of nested enters, who, CPU at entry
        self._inside: dict[int, float] = {}  # thread -> when its call went in (after pacing)
        self._clock, self._row = None, 0  # the other front-end processes' tenants (serve/rpc/shared_clock.py)
        self.counters: Counter = Counter()  # calls, waited (calls that queued), paced_s, pace_sleeps, stuck
        # the same by tenant (its name; the operator's metrics show which tenants wait and are paced)
        self._by_tenant: dict = {}

    @staticmethod
    def _check(slots, share, overhead_s, burst_s) -> None:
        if type(slots) is not int or slots < 1:
            raise ValueError(f"gate slots must be an integer >= 1, got {slots!r}")
        if not 0.01 <= share <= 1.0:
            raise ValueError(f"gate share must lie in [0.01, 1] (of the wall clock), got {share!r}")
        if not 0 <= overhead_s <= 0.1 or not 0 < burst_s <= 10:
            raise ValueError("gate overhead_s must lie in [0, 0.1] s and burst_s in (0, 10] s")

    # ---- a call's turn ---------------------------------------------------------------------------
    def enter(self, connection, tenant=None, weight: float = 1.0) -> None:
        """Waits for a slot (in fair order) and for the share to allow one more call."""
        loc = self._local
        if getattr(loc, "depth", 0):  # nested (a gated method calling another): one turn
            loc.depth += 1
            return
        self._pace(tenant, weight)
        with self._lock:
            self.counters["calls"] += 1
            mine_counts = self._tenant_counts(tenant)
            mine_counts["calls"] += 1
            ticket = None
            if self._free > 0 and not self._queues:
                self._free -= 1
                self._now_v = max(self._now_v, self._tenant_v.get(tenant, 0.0))
            else:
                if tenant not in self._queues:  # a tenant with no call waiting starts at the present turn
                    self._tenant_v[tenant] = max(self._tenant_v.get(tenant, 0.0), self._now_v)
                mine = self._queues.setdefault(tenant, [])
                start = max([self._conn_v.get(connection, 0.0)] + [v for v, _, _ in mine[:1]])
                ticket = _Ticket()
                heapq.heappush(mine, (start, next(self._arrival), ticket))
                self.counters["waited"] += 1
                mine_counts["waited"] += 1
        if ticket is not None:
            self._wait_turn(ticket)
        with self._lock:
            self._inside[threading.get_ident()] = time.monotonic()
        loc.depth, loc.who, loc.cpu = 1, (connection, tenant, weight), time.thread_time()

    def _wait_turn(self, ticket: _Ticket) -> None:
        """Until leave() hands a slot over (sets the ticket), or every slot is stuck."""
        while not ticket.wait(STUCK_S):
            with self._lock:
                if ticket.is_set():
                    return
                now = time.monotonic()
                if self._inside and all(now - t > STUCK_S for t in self._inside.values()):
                    ticket.gone = True
                    self._free -= 1  # over the limit; the stuck ones give theirs back as they leave
                    self.counters["stuck"] += 1
                    return

    def leave(self) -> None:
        loc = self._local
        loc.depth -= 1
        if loc.depth:
            return
        connection, tenant, weight = loc.who
        cost = time.thread_time() - loc.cpu + self.overhead_s
        with self._lock:
            self._inside.pop(threading.get_ident(), None)
            # turns count calls, a cheap poll and a costly submit alike; the share counts their CPU
            self._tenant_v[tenant] = max(self._tenant_v.get(tenant, 0.0), self._now_v) + 1.0 / max(weight, 0.01)
            self._conn_v[connection] = self._conn_v.get(connection, 0.0) + 1.0
            # the tenant owes what its call cost beyond the estimate _pace took (at most 1 s: one
            # huge call makes its tenant wait a while, not for ever)
            now = time.monotonic()
            self._used(tenant, cost, now)
            self._publish(now)
            bucket = self._budget.get(tenant)
            if bucket is not None:
                bucket[0] = max(-1.0, bucket[0] - (cost - self.overhead_s))
            self._free += 1
            self._admit_waiting()
            if len(self._tenant_v) + len(self._conn_v) > MAX_REMEMBERED:
                self._forget_idle()

    def charge(self, tenant, seconds: float) -> None:
        """CPU spent for `tenant` outside its calls (the HTTP front end's event loop: parsing, routing,
        replies): counted in its use and taken from its budget, so that its next call paces for it as
        for its calls' own (at most 1 s owed, as in leave())."""
        if seconds <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._used(tenant, seconds, now)
            bucket = self._budget.get(tenant)
            if bucket is not None:
                bucket[0] = max(-1.0, bucket[0] - seconds)

    def _admit_waiting(self) -> None:
        """Hands free slots to the waiting calls: the tenant furthest behind, its connection furthest
        behind (lock held)."""
        while self._free > 0 and self._queues:
            tenant = min(self._queues, key=lambda t: (self._tenant_v[t], self._queues[t][0][1]))
            mine = self._queues[tenant]
            _, _, ticket = heapq.heappop(mine)
            if not mine:
                del self._queues[tenant]
            if ticket.gone:
                continue
            self._free -= 1
            self._now_v = max(self._now_v, self._tenant_v[tenant])
            ticket.set()

    def _forget_idle(self) -> None:
        """Drops the virtual times of tenants no longer ahead of the present turn (they would start at
        it anyway) and of connections with no call waiting."""
        waiting = {t for t in self._queues}
        self._tenant_v = {t: v for t, v in self._tenant_v.items() if t in waiting or v > self._now_v}
        self._conn_v = dict(sorted(self._conn_v.items(), key=lambda kv: kv[1])[-MAX_REMEMBERED // 2:])

    def _rate(self, tenant, now: float) -> float:
        """Seconds of CPU per second the tenant may use: its weight's part of the share among the
        tenants that called within the last second (lock held)."""
        total = sum(w for _, w in self._calling(now).values())
        if self._clock is not None:
            total += self._clock.others(self._row, now, USE_TAU_S)[0]
        return self.share * self._busy[tenant][1] / total

    def _used(self, tenant, cost: float, now: float) -> float:
        """The tenant's recent CPU use (decayed), after adding `cost` (lock held)."""
        use = self._use.get(tenant)
        if use is None:
            use = self._use[tenant] = [0.0, now]
        use[0] = use[0] * math.exp(-(now - use[1]) / USE_TAU_S) + cost
        use[1] = now
        return use[0]

    def _heaviest(self, tenant, weight: float, now: float) -> bool:
        """Whether `tenant` uses the most of the clock for its weight among the tenants busy now: only
        that one is paced. A victim whose own requests are quick but come back to back is never held
        to a part of the clock while a flooding tenant uses more (its pacing stretched a victim's
        p95 tenfold under 32 polling connections); a lone tenant is always the heaviest (lock held)."""
        mine = self._used(tenant, 0.0, now) / weight
        if self._clock is not None and self._clock.others(self._row, now, USE_TAU_S)[1] > mine:
            return False
        return all(self._used(t, 0.0, now) / w <= mine for t, (_, w) in self._busy.items() if t != tenant)

    def _publish(self, now: float) -> None:
        """This process's row of the shared clock: its tenants calling now and the heaviest (lock held)."""
        if self._clock is None:
            return
        busy = self._calling(now)
        heaviest = max((self._used(t, 0.0, now) / w for t, (_, w) in busy.items()), default=0.0)
        self._clock.publish(self._row, sum(w for _, w in busy.values()), now, heaviest, now)

    def _calling(self, now: float) -> dict:
        """The tenants that called within the last BUSY_S, the others forgotten (lock held)."""
        self._busy = {t: (at, w) for t, (at, w) in self._busy.items() if now - at < BUSY_S}
        return self._busy

    def share_clock(self, clock, row: int) -> None:
        """Paces this process's tenants against those of the other processes on `clock` (this one's row: `row`)."""
        with self._lock:
            self._clock, self._row = clock, row

    def _pace(self, tenant, weight: float) -> None:
        """Before a call queues: sleeps (holding no slot) while its tenant is over its part of the
        clock, then takes the call's estimated cost (overhead_s; leave() charges the rest).

        One thread of a tenant paces at a time; its others wait on the tenant's lock, asleep. Each
        pacing thread once woke when the budget came back, one went in and the rest found it spent
        again and slept a fraction of a millisecond: 32 connections of one tenant polling kept 0.6
        of a core busy with those wake-ups while their calls used 0.17 of the clock."""
        with self._lock:
            pacer = self._pacers.get(tenant)
            if pacer is None:
                if len(self._pacers) > MAX_REMEMBERED:
                    self._pacers = {t: p for t, p in self._pacers.items() if p.locked()}
                pacer = self._pacers[tenant] = threading.Lock()
        with pacer:
            self._pace_turn(tenant, weight)

    def _pace_turn(self, tenant, weight: float) -> None:
        weight = max(weight, 0.01)
        while True:
            with self._lock:
                now = time.monotonic()
                self._busy[tenant] = (now, weight)
                rate = self._rate(tenant, now)
                bucket = self._budget.setdefault(tenant, [self.burst_s, now])
                bucket[0] = min(self.burst_s, bucket[0] + (now - bucket[1]) * rate)
                bucket[1] = now
                self._publish(now)
                if bucket[0] < 0 and not self._heaviest(tenant, weight, now):
                    # it goes in while another tenant uses more, and what it overspent meanwhile is not kept
                    # against it: kept, a victim's debt grew over many calls and was paid at once, in one
                    # sleep of 0.1-0.4 s, the first time it read as the heaviest (results/soak/cpu/victim_pacing)
                    bucket[0] = 0.0
                if bucket[0] >= 0:
                    bucket[0] -= self.overhead_s
                    if len(self._budget) > MAX_REMEMBERED:
                        self._budget = {t: b for t, b in self._budget.items() if t in self._busy}
                    return
                wait = -bucket[0] / rate
                self.counters["paced_s"] += wait
                self.counters["pace_sleeps"] += 1
                mine = self._tenant_counts(tenant)
                mine["paced_s"] += wait
                mine["pace_sleeps"] += 1
            time.sleep(wait)

    @contextmanager
    def call(self, connection, tenant=None, weight: float = 1.0):
        """One call of `connection` (of `tenant`, whose turns follow `weight`) through the gate."""
        self.enter(connection, tenant, weight)
        try:
            yield
        finally:
            self.leave()

    @contextmanager
    def released(self):
        """Inside a call: gives the slot back around a blocking wait and queues again after it.
        Outside any call it does nothing."""
        loc = self._local
        depth = getattr(loc, "depth", 0)
        if not depth:
            yield
            return
        who = loc.who
        loc.depth = 1
        self.leave()
        try:
            yield
        finally:
            self.enter(*who)
            loc.depth = depth

    def held(self) -> bool:
        """Whether this thread is inside a call now."""
        return bool(getattr(self._local, "depth", 0))

    def metrics(self) -> dict[str, int]:
        """Its counters as the server's metrics show them (summed over the front-end processes)."""
        with self._lock:
            c = self.counters
            return {"gate_calls": c["calls"], "gate_waited": c["waited"], "gate_stuck": c["stuck"],
                    "gate_paced_ms": int(c["paced_s"] * 1000)}

    def _tenant_counts(self, tenant) -> Counter:
        """The counters of `tenant` (lock held); past MAX_REMEMBERED tenants the oldest are dropped."""
        counts = self._by_tenant.get(tenant)
        if counts is None:
            if len(self._by_tenant) >= MAX_REMEMBERED:
                self._by_tenant.pop(next(iter(self._by_tenant)))
            counts = self._by_tenant[tenant] = Counter()
        return counts

    def tenant_metrics(self) -> dict[str, dict[str, int]]:
        """tenant -> its calls, the calls that queued for a slot, its pacing sleeps and the time paced (ms),
        for the tenants known by name (a connection before its token check has none)."""
        with self._lock:
            return {t: {"gate_calls": c["calls"], "gate_waited": c["waited"], "gate_pace_sleeps": c["pace_sleeps"],
                        "gate_paced_ms": int(c["paced_s"] * 1000)}
                    for t, c in self._by_tenant.items() if isinstance(t, str)}

    def in_use(self) -> int:
        """Slots taken now."""
        with self._lock:
            return self.slots - self._free

    def configure(self, slots: int, share: float, overhead_s: float, burst_s: float) -> None:
        """New limits, in place: calls inside keep their slots (fewer slots take effect as they leave)."""
        self._check(slots, share, overhead_s, burst_s)
        with self._lock:
            self._free += slots - self.slots
            self.slots, self.share, self.overhead_s, self.burst_s = slots, share, overhead_s, burst_s
            self._admit_waiting()


GATE = Gate()


def configure(slots: int = 1, share: float = 0.5, overhead_s: float = 100e-6, burst_s: float = 0.02) -> Gate:
    """Sets the process-wide gate's limits (the server calls it before it accepts connections)."""
    GATE.configure(slots, share, overhead_s, burst_s)
    return GATE
