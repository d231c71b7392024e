"""Where the machine's cores went while a flood's probes ran: CPU by process group, read from /proc (Linux).

On an H200 the slowest runs under one flood were slower in every host-side part together (the victim's
submit call, the engine's step, the way back), not in one part (results/soak/nvidia_h200/quiet_http). That
points at the machine's cores, not at the engine. A window here tells the server's processes from the
flood's client, the soak's own process (the victim's client) and everything else on the machine."""
from __future__ import annotations

import os
import time
from collections import defaultdict

_TICKS = os.sysconf("SC_CLK_TCK")


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, CPU ticks so far, user and system, all its threads)."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                data = f.read()
        except OSError:  # gone meanwhile
            continue
        # the command, in brackets, may hold spaces and brackets itself: the fields start after its last ")"
        fields = data[data.rindex(b")") + 2:].split()
        out[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid; utime + stime
    return out


def _machine() -> tuple[int, int]:
    """(busy, all) ticks over every core since boot, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]  # user .. steal; guest time is inside user
    idle = values[3] + values[4]  # idle, iowait
    return sum(values) - idle, sum(values)


def _groups(processes: dict, roots: dict) -> dict[int, str]:
    """pid -> the first group (in `roots`' order) whose root it is or descends from."""
    children = defaultdict(list)
    for pid, (ppid, _) in processes.items():
        children[ppid].append(pid)
    member: dict[int, str] = {}
    for name, pids in roots.items():
        todo = [p for p in pids if p in processes]
        while todo:
            pid = todo.pop()
            if pid not in member:
                member[pid] = name
                todo.extend(children[pid])
    return member


class CpuWindow:
    """CPU used by each group of processes between `start()` and `stop()`, in cores (CPU seconds per second).

    groups: name -> root pids; a process counts for the first group it belongs to, so name a process's own
    group before its parent's. The rest of the machine is `other`. A process that ends inside the window is
    missed (its ticks leave with it); one that starts inside counts from its start."""

    def __init__(self, groups: dict[str, list[int]]):
        self.groups = groups
        self._start: tuple | None = None

    def start(self) -> "CpuWindow":
        self._start = (time.monotonic(), _processes(), _machine())
        return self

    def stop(self) -> dict:
        if self._start is None:
            raise RuntimeError("CpuWindow.stop() before start()")
        t0, before, (busy0, all0) = self._start
        after, (busy1, all1) = _processes(), _machine()
        seconds = max(time.monotonic() - t0, 1e-9)
        member = _groups(after, self.groups)
        used: dict[str, float] = {name: 0.0 for name in [*self.groups, "other"]}
        busiest: dict[str, float] = {}
        for pid, (_, ticks) in after.items():
            spent = (ticks - before[pid][1] if pid in before else ticks) / _TICKS
            group = member.get(pid, "other")
            used[group] += spent
            busiest[group] = max(busiest.get(group, 0.0), spent)
        cores = os.cpu_count() or 1
        return {"window_s": round(seconds, 2),
                "cores": {name: round(s / seconds, 2) for name, s in used.items()},
                # its busiest process alone (the server's: the engine's, or a front-end's under a flood)
                "busiest_process_cores": {name: round(s / seconds, 2) for name, s in busiest.items()},
                "machine_cores": cores,
                "machine_busy_cores": round(cores * (busy1 - busy0) / max(all1 - all0, 1), 2)}
