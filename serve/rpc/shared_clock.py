"""The tenants' use of the front ends' clock, seen by every front-end process of one server.

Why: the gate (serve/rpc/gate.py) paces only the tenant using the most of the clock for its weight,
at its part of `rpc.gate_share` among the tenants calling now. With a front-end process per tenant
(serve/rpc/tenant_processes.py) each process's gate saw one tenant only: a flood was never the
heaviest against anyone and ran unpaced, taking the cores the engine process steps on (on 2 cores
its throughput tripled and a victim's engine steps slowed 2-3x, results/soak/cpu/intervals), or,
paced in every process alike, a lone victim was paced too (results/soak/cpu/front_end_trace).

How: one row per process in shared memory, written only by its owner after each call: the weight
of its tenants calling within the last second, when the last call was, and the heaviest of them
(its decayed CPU use per weight, and when that was taken). A gate adds the other rows' weights to
its own when it splits the share, and paces its tenant only if no row holds a heavier one. Rows are
plain doubles written without a lock: a torn read costs one call a slightly wrong estimate, the
next call reads it right.
"""

from __future__ import annotations

import math
import multiprocessing

FIELDS = 4  # busy weight, last call at (monotonic), heaviest use per weight, that use's time
BUSY_S = 1.0  # a row whose last call is older than this calls no more (as the gate's own tenants)


class SharedClock:
    def __init__(self, rows: int, array=None):
        if rows < 1:
            raise ValueError(f"a shared clock needs at least one row, got {rows}")
        self.rows = rows
        self.array = array if array is not None else multiprocessing.get_context("spawn").RawArray("d", rows * FIELDS)

    def publish(self, row: int, busy_weight: float, at: float, heaviest: float, use_at: float) -> None:
        base = row * FIELDS
        a = self.array
        a[base + 2], a[base + 3], a[base] = heaviest, use_at, busy_weight
        a[base + 1] = at  # last: a reader that sees it recent sees the rest of this publish or a later one

    def others(self, row: int, now: float, tau_s: float) -> tuple[float, float]:
        """(the weight calling now in the other rows, the heaviest use per weight among them, decayed to now)."""
        a = self.array
        weight, heaviest = 0.0, 0.0
        for r in range(self.rows):
            if r == row:
                continue
            base = r * FIELDS
            if now - a[base + 1] >= BUSY_S or a[base] <= 0:
                continue
            weight += a[base]
            heaviest = max(heaviest, a[base + 2] * math.exp(-max(0.0, now - a[base + 3]) / tau_s))
        return weight, heaviest

    def __reduce__(self):  # to a spawned process: the same shared memory
        return (SharedClock, (self.rows, self.array))
