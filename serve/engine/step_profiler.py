"""A profile of the engine's next few steps, taken on the thread that runs them.

A cold server's first step at camera load took 195-232 ms where a warm server's first took 64-158, with the
GPU busy and no kernel compiled late (results/streams/nvidia_h200/cold): host work of a kind the phase log
cannot name (first-time allocations, synchronising CUDA calls, Python on a path first taken). Armed with
`Engine.profile_steps(n)`, the next n steps each run under torch.profiler on the loop's own thread, and
each step's host operators and CUDA runtime calls are kept by self CPU time: the rows that tell a
cudaHostAlloc or a stream synchronisation from our own Python. A profiled step is slower than it would be
(the profiler's own cost), so compare profiled steps with profiled steps. Unarmed, a step pays one
attribute check.
"""

from __future__ import annotations

import time

TOP_OPS = 25  # rows kept per step, by self CPU time


class StepProfiler:
    def __init__(self, steps: int, cuda: bool):
        """cuda: also the CUDA runtime's calls (cudaMalloc, cudaHostAlloc, synchronisations, launches)."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.left, self.cuda = steps, cuda
        self._taken: list[tuple[float, object]] = []  # (wall s, profile): read later, so no step pays the reading
        with self._profile():  # the profiler's own first use (CUPTI's start) is paid here, not by the first step
            pass

    def _profile(self):
        from torch.profiler import ProfilerActivity, profile

        return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else []))

    def run(self, fn):
        """fn() under the profiler; its result. Records the step's wall time and top operators."""
        start = time.perf_counter()
        with self._profile() as prof:
            out = fn()
        self.left -= 1
        self._taken.append((time.perf_counter() - start, prof))
        return out

    @property
    def results(self) -> list[dict]:
        """Each profiled step's wall ms (the profiler's start and stop included) and its top operators."""
        return [{"wall_ms": round(wall * 1e3, 2), "ops": top_ops(prof.key_averages())} for wall, prof in self._taken]


def top_ops(averages, n: int = TOP_OPS) -> list[list]:
    """[name, calls, self CPU ms, total CPU ms] of the n operators with the most self CPU time."""
    rows = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:n]
    return [[e.key, int(e.count), round(e.self_cpu_time_total / 1e3, 3), round(e.cpu_time_total / 1e3, 3)]
            for e in rows]
