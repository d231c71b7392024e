"""Serving metrics from per-request records (pure Python).

Average token latency is the paper's metric (section 6.1): the sum of the requests' end-to-end
latencies divided by the total number of tokens. `tokens="output"` (default) counts generated
tokens (a head answer counts one); `tokens="all"` adds the prompt tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    request_id: str
    app: str | None
    adapter: str | None
    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    slo_ms: float | None = None
    first_scheduled_ms: float | None = None
    first_token_ms: float | None = None
    finish_ms: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_ms is not None

    @property
    def latency_ms(self) -> float:
        return self.finish_ms - self.arrival_ms

    @property
    def wait_ms(self) -> float:
        """Queueing delay: arrival to first scheduled step."""
        return self.first_scheduled_ms - self.arrival_ms

    @property
    def met_slo(self) -> bool:
        return self.slo_ms is None or self.latency_ms <= self.slo_ms


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Metrics:
    requests: int  # in the trace
    completed: int
    avg_token_latency_ms: float
    avg_latency_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    throughput_rps: float  # completed requests per second over the run
    throughput_tps: float  # generated tokens per second
    slo_attainment: float  # share of completed requests within their latency target
    avg_wait_ms: float
    max_wait_ms: float
    switches: int = 0
    switch_ms: float = 0.0
    duration_ms: float = 0.0
    per_app: dict[str, dict] = field(default_factory=dict)

    def as_row(self) -> dict:
        row = asdict(self)
        row.pop("per_app")
        return row


def _token_latency(records: Sequence[RequestRecord], tokens: str) -> float:
    n = sum(r.output_tokens + (r.prompt_tokens if tokens == "all" else 0) for r in records)
    return sum(r.latency_ms for r in records) / n if n else math.nan


def summarize(records: Iterable[RequestRecord], *, switches: int = 0, switch_ms: float = 0.0,
              tokens: str = "output") -> Metrics:
    if tokens not in ("output", "all"):
        raise ValueError(f"tokens {tokens!r} is not one of ('output', 'all')")
    records = list(records)
    done = [r for r in records if r.done]
    lat = [r.latency_ms for r in done]
    waits = [r.wait_ms for r in done]
    start = min((r.arrival_ms for r in records), default=0.0)
    end = max((r.finish_ms for r in done), default=start)
    duration = end - start
    per_s = 1e3 / duration if duration > 0 else math.nan
    per_app = {}
    for app in sorted({r.app or "-" for r in done}):
        rs = [r for r in done if (r.app or "-") == app]
        per_app[app] = {"completed": len(rs), "avg_token_latency_ms": _token_latency(rs, tokens),
                        "p95_ms": percentile([r.latency_ms for r in rs], 95),
                        "slo_attainment": sum(r.met_slo for r in rs) / len(rs)}
    return Metrics(
        requests=len(records), completed=len(done),
        avg_token_latency_ms=_token_latency(done, tokens),
        avg_latency_ms=sum(lat) / len(lat) if lat else math.nan,
        p50_ms=percentile(lat, 50), p95_ms=percentile(lat, 95), p99_ms=percentile(lat, 99),
        throughput_rps=len(done) * per_s, throughput_tps=sum(r.output_tokens for r in done) * per_s,
        slo_attainment=sum(r.met_slo for r in done) / len(done) if done else math.nan,
        avg_wait_ms=sum(waits) / len(waits) if waits else math.nan,
        max_wait_ms=max(waits, default=math.nan),
        switches=switches, switch_ms=switch_ms, duration_ms=duration, per_app=per_app)
