"""A short wait for a tenant about to come back (no torch here).

A client that sends a request, waits for its answer and sends the next (a closed loop: a retrieval
user's next question, a probe, a camera that sends its next chunk when the last is answered) has
nothing in the engine between its requests. A work-conserving step loop then starts another tenant's
step in that gap, and the client's next request waits for the whole of it. Under the soak's floods on
an H200 that wait was the largest part of a victim's slow requests: its hand-in took 4.8-7.3 ms in
the slowest tenth against 1.5 quiet, where a step of the tiny model takes about as long as the
victim's own (results/soak/nvidia_h200/warm_adapter). This is the "deceptive idleness" of disk
schedulers (Iyer and Druschel, SOSP 2001), met the same way: when a tenant's last request finishes
while other tenants have work, the loop waits up to about that tenant's usual gap for its next
request before starting a step without it.

- A tenant's gap (its last request finished -> its next one reached the serving loop, `Request.received`:
  not when a step in flight let the loop take it in, or a gap once stretched by a step would stretch the
  average until the waits stopped) is learned as a moving average.
  A tenant is waited for only once a gap of it is known and that average is at most `max_ms`, and for
  at most `SLACK` times it (never more than `max_ms`): a tenant that does not come back soon stops
  being waited for. A gap is learned as at most `GAP_CEILING` times `max_ms`: a client's pause (the soak's
  victim between its probes alone and under a flood, a camera reconnecting) had put the average over
  `max_ms` for its next 8-12 requests, each then waiting for a whole step of the flood (5-8 ms on an
  H200, the `queue2048` flood's slowest probes in results/soak/nvidia_h200/after_pacing). Clipped, a
  tenant whose usual gap is under half of `max_ms` is waited for again right after a pause, and one
  whose gaps are all long still stops being waited for after two of them.
- Every wait is paid from one budget that fills at `BUDGET_RATE` of the wall clock (holding at most
  `BURST` waits of `max_ms`): however tenants time their requests, waiting takes at most half of the
  loop's time, so the others' throughput is at least half of what it was.
- A tenant alone is never waited for: the loop only asks while some other tenant has work. Nor is one
  waited for while a tenant as light holds work: only a tenant that had fewer requests in the engine at
  once (its peak over its last busy spell) than every tenant with work now holds. A flood's own idle
  moments then hold no victim's request: on 2 CPU cores the rule took the soak's `topup4` from 284 waits
  to 21, and its victim requests held over 4 ms before their first step from about 30 of 200 to none
  (results/soak/cpu/anticipation).
- An aborted request (its client went away) opens no wait.
- Only the serving loop of one engine waits (serve/rpc/loop.py); tensor-parallel and replica engines do not.
"""

from __future__ import annotations

import math
from collections import Counter

SLACK = 2.0  # a wait lasts at most this many of the tenant's usual gaps
ALPHA = 0.3  # the moving average's weight of the newest gap
GAP_CEILING = 2.0  # a gap is learned as at most this many max_ms (one pause must not outweigh many gaps)
BUDGET_RATE = 0.5  # seconds of waiting earned per second of wall clock
BURST = 8  # the budget holds at most this many waits of max_ms


def check_anticipate_ms(value) -> None:
    """EngineConfig.anticipate_ms: None (off) or a finite number of ms in (0, 1000]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= 1000:
        raise ValueError(f"anticipate_ms={value!r}: give the longest wait, in ms, for a tenant about to come back "
                         "(a number in (0, 1000]), or null for none")


class Anticipation:
    """Which tenants went idle when, their usual gaps, and the wait budget; times in seconds."""

    def __init__(self, max_ms: float, now: float):
        check_anticipate_ms(max_ms)
        self.max_s = max_ms / 1e3
        self._live: Counter = Counter()  # tenant -> its requests in the engine
        self._peak: dict = {}  # tenant -> most of its requests in the engine at once, this busy spell or its last
        self._idle_since: dict = {}  # tenant -> when its last request finished (until its next arrives)
        self._open: set = set()  # tenants of _idle_since whose wait has not run out
        self._held_for: set = set()  # tenants of _idle_since some wait was for
        self._gap: dict = {}  # tenant -> moving average of its gaps
        self._budget, self._budget_at = self.max_s * BURST, now
        self.counters: Counter = Counter()  # waits, waited_ms; of tenants waited for: came_back (within the window), late

    def window(self, tenant) -> float:
        """How long after its last request finished `tenant` is waited for (0: not at all)."""
        gap = self._gap.get(tenant)
        if gap is None or gap > self.max_s:
            return 0.0
        return min(self.max_s, SLACK * gap)

    def taken_in(self, tenant, now: float) -> None:
        """A request of `tenant` was taken in: its gap is learned, its wait (if any) is over."""
        self._live[tenant] += 1
        since = self._idle_since.pop(tenant, None)
        live = self._live[tenant]
        self._peak[tenant] = live if live == 1 else max(self._peak.get(tenant, 0), live)  # 1: a new busy spell
        self._open.discard(tenant)
        if since is None:
            return
        gap = max(0.0, now - since)
        if tenant in self._held_for:  # a wait was for it: did it come within its window?
            self._held_for.discard(tenant)
            self.counters["came_back" if gap <= self.window(tenant) else "late"] += 1
        gap = min(gap, GAP_CEILING * self.max_s)
        old = self._gap.get(tenant)
        self._gap[tenant] = gap if old is None else old + ALPHA * (gap - old)

    def gone(self, tenant, now: float, finished: bool) -> None:
        """A request of `tenant` finished (or, `finished` false, was aborted: its client may be gone, so
        its tenant's last one opens no wait)."""
        self._live[tenant] -= 1
        if self._live[tenant] > 0:
            return
        del self._live[tenant]
        self._held_for.discard(tenant)
        if finished:
            self._idle_since[tenant] = now
            self._open.add(tenant)

    def wait_s(self, now: float) -> float:
        """How long the loop should wait now for a tenant about to come back (0: step at once). The
        caller asks only while some other tenant has work."""
        if not self._open:
            return 0.0
        self._budget = min(self.max_s * BURST, self._budget + BUDGET_RATE * (now - self._budget_at))
        self._budget_at = now
        lightest = min(self._live.values(), default=0)  # the fewest requests a tenant with work holds
        longest, waited_for = 0.0, []
        for tenant in list(self._open):
            left = self._idle_since[tenant] + self.window(tenant) - now
            if left <= 0:
                self._open.discard(tenant)  # run out: its gap is still learned when it comes
            elif self._peak.get(tenant, 0) < lightest:
                longest = max(longest, left)
                waited_for.append(tenant)
        wait = max(0.0, min(longest, self._budget))
        if wait > 0:  # an empty budget waits for no one: its tenants' arrivals are not counted as waited for
            self._held_for.update(waited_for)
        return wait

    def waited(self, seconds: float) -> None:
        """The loop waited `seconds` (from the budget)."""
        self._budget -= seconds
        self.counters["waits"] += 1
        self.counters["waited_ms"] += seconds * 1e3

    def stats(self) -> dict:
        c = self.counters
        return {"max_ms": self.max_s * 1e3, "waits": c["waits"], "waited_ms": round(c["waited_ms"], 3),
                "came_back": c["came_back"], "late": c["late"]}
