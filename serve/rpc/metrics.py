"""Server and engine counters in the Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

import re

_GAUGES = ("num_blocks", "block_size", "blocks_in_use", "waiting", "running", "in_flight", "encoder_cache_size",
           "step_time_mean_ms", "step_time_last_ms")


def _name(key: str) -> str:
    return "vlora_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def prometheus_text(stats, server: dict[str, int]) -> str:
    """`stats`: the engine's EngineStats; `server`: counters of the RPC layer."""
    lines = []
    for key, value in vars(stats).items():
        if key == "anticipation" and value:  # the waits for a returning tenant: counters, and the longest wait's setting
            for part, number in value.items():
                name = _name(f"engine_anticipation_{part}")
                lines += [f"# TYPE {name} {'gauge' if part == 'max_ms' else 'counter'}", f"{name} {number}"]
            continue
        if key == "gc" and value:  # the process's garbage collections by generation: counts, pause ms, longest
            for part in next(iter(value.values())):
                name = _name(f"engine_gc_{part}")
                lines.append(f"# TYPE {name} {'gauge' if part == 'max_ms' else 'counter'}")
                lines += [f'{name}{{generation="{gen[3:]}"}} {row[part]}' for gen, row in value.items()]
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        kind = "gauge" if key in _GAUGES else "counter"
        lines += [f"# TYPE {_name('engine_' + key)} {kind}", f"{_name('engine_' + key)} {value}"]
    for key, value in sorted(server.items()):
        kind = "gauge" if key == "connections" else "counter"
        lines += [f"# TYPE {_name('server_' + key)} {kind}", f"{_name('server_' + key)} {value}"]
    return "\n".join(lines) + "\n"
