"""The interpreter's garbage collections, their pauses timed (no torch here).

CPython collects the youngest objects every few hundred allocations (net of those freed) and, after
every tenth collection of the middle generation, all of them ("full"), walking every tracked object not
frozen. Each collection stops every thread of the process for as long as its walk takes: a step, or a
request waiting to be taken in.

`PAUSES` times every collection (gc.callbacks), by generation, and keeps their sum, so a request can
say how much of its time the collector took (serve/engine/engine.py) and the engine's stats how often
and how long it stopped the process. Under the soak's floods on an H200 the engine process ran no full
collection at all and its young ones took at most 2-4 ms (results/soak/nvidia_h200/passed_over).
"""

from __future__ import annotations

import gc
import time


class CollectionPauses:
    """Every garbage collection of this process, timed; times in seconds."""

    def __init__(self) -> None:
        self.total_s = 0.0  # all collections so far
        self._by_gen = [[0, 0.0, 0.0] for _ in range(3)]  # count, seconds, longest
        self._started: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        # called by whichever thread collects, holding the interpreter: no lock needed
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        took, self._started = time.perf_counter() - self._started, None
        row = self._by_gen[min(int(info.get("generation", 2)), 2)]
        row[0] += 1
        row[1] += took
        row[2] = max(row[2], took)
        self.total_s += took

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def stats(self) -> dict:
        return {f"gen{g}": {"count": n, "ms": round(s * 1e3, 3), "max_ms": round(m * 1e3, 3)}
                for g, (n, s, m) in enumerate(self._by_gen)}


PAUSES = CollectionPauses()
