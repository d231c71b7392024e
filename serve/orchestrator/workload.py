"""Synthetic serving workloads and the JSONL trace format (pure Python, seeded).

A workload draws arrivals at `rate` requests per second (Poisson, or gamma with a coefficient
of variation `cv` for burstier traffic), gives each request an application by share and an
adapter by popularity: the most requested adapter takes `skewness` of the adapter requests and
the other `num_adapters - 1` share the rest evenly (so `skewness >= 1 / num_adapters`).

The two applications' shapes follow the paper (section 6.2): video analytics sends several
frames (~256 tokens each) and wants a task-head output or a few tokens; visual retrieval sends
one image and a question and reads tens to hundreds of tokens. Each request's latency target is
`slo_ms + slo_per_token_ms * output_tokens` of its application.

Trace file (JSONL): an optional header line `{"trace": "vlora", "version": 1, "spec": {...}}`,
then one request per line with the fields of `RequestView` (request_id, arrival_ms, adapter,
prompt_tokens, output_tokens; optional output_mode, app, slo_ms, priority).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .types import RequestView

ARRIVALS = ("poisson", "gamma")
TRACE_VERSION = 1


@dataclass
class AppSpec:
    name: str
    share: float  # share of all requests
    frames: tuple[int, int] = (1, 1)  # images or video frames per request (inclusive range)
    tokens_per_frame: int = 256
    text_tokens: tuple[int, int] = (16, 48)  # the question / instruction
    head_share: float = 0.0  # share answered by the task head (one output, one prefill)
    output_tokens: tuple[int, int] = (5, 10)  # generated tokens otherwise (inclusive range)
    slo_ms: float = 2000.0
    slo_per_token_ms: float = 0.0
    priority: float = 1.0

    def __post_init__(self) -> None:
        for name in ("frames", "text_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            low = 0 if name == "text_tokens" else 1
            if not low <= lo <= hi:
                raise ValueError(f"app {self.name!r}: {name} must be an inclusive range "
                                 f"{low} <= lo <= hi, got {(lo, hi)}")
            setattr(self, name, (int(lo), int(hi)))
        if not 0 <= self.head_share <= 1 or self.share < 0:
            raise ValueError(f"app {self.name!r}: share must be >= 0 and head_share in [0, 1]")


def video_analytics(share: float = 0.5) -> AppSpec:
    return AppSpec("video_analytics", share, frames=(4, 8), head_share=0.5, output_tokens=(5, 10),
                   slo_ms=1500.0, priority=2.0)


def visual_retrieval(share: float = 0.5) -> AppSpec:
    return AppSpec("visual_retrieval", share, frames=(1, 1), output_tokens=(32, 256),
                   slo_ms=2000.0, slo_per_token_ms=50.0)


@dataclass
class WorkloadSpec:
    rate: float = 6.0  # requests per second
    duration_s: float = 60.0
    arrival: str = "poisson"  # poisson | gamma
    cv: float = 1.0  # gamma: coefficient of variation of the inter-arrival times
    num_adapters: int = 8
    skewness: float = 0.6  # share of the most requested adapter among adapter requests
    base_share: float = 0.0  # share of requests for the base model (no adapter)
    apps: list[AppSpec] = field(default_factory=lambda: [video_analytics(), visual_retrieval()])
    seed: int = 0

    def __post_init__(self) -> None:
        self.apps = [a if isinstance(a, AppSpec) else AppSpec(**a) for a in self.apps]
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival {self.arrival!r} is not one of {ARRIVALS}")
        if self.rate <= 0 or self.duration_s <= 0 or self.cv <= 0:
            raise ValueError(f"rate, duration_s and cv must be > 0, got {self.rate}, {self.duration_s}, {self.cv}")
        if self.num_adapters < 1:
            raise ValueError(f"num_adapters must be >= 1, got {self.num_adapters}")
        if not 1 / self.num_adapters - 1e-9 <= self.skewness <= 1:
            raise ValueError(f"skewness {self.skewness} must lie in [1/num_adapters, 1] = "
                             f"[{1 / self.num_adapters:.3g}, 1] for {self.num_adapters} adapters")
        if self.num_adapters == 1 and self.skewness != 1:
            raise ValueError("with one adapter, skewness must be 1")
        if not 0 <= self.base_share < 1:
            raise ValueError(f"base_share must lie in [0, 1), got {self.base_share}")
        if not self.apps or sum(a.share for a in self.apps) <= 0:
            raise ValueError("apps must hold at least one application with a share > 0")


def adapter_names(n: int) -> list[str]:
    return [f"adapter-{i:03d}" for i in range(n)]


def popularity(num_adapters: int, skewness: float) -> list[float]:
    """Request share of each adapter: the first takes `skewness`, the others split the rest."""
    if num_adapters == 1:
        return [1.0]
    rest = (1 - skewness) / (num_adapters - 1)
    return [skewness] + [rest] * (num_adapters - 1)


def _interarrivals(spec: WorkloadSpec, rng: random.Random):
    mean_s = 1.0 / spec.rate
    if spec.arrival == "poisson":
        while True:
            yield rng.expovariate(spec.rate)
    shape = 1.0 / spec.cv ** 2  # gamma(k, theta): mean k*theta, cv 1/sqrt(k)
    while True:
        yield rng.gammavariate(shape, mean_s / shape)


def generate(spec: WorkloadSpec) -> list[RequestView]:
    rng = random.Random(spec.seed)
    names = adapter_names(spec.num_adapters)
    weights = popularity(spec.num_adapters, spec.skewness)
    app_weights = [a.share for a in spec.apps]
    out, t = [], 0.0
    for gap in _interarrivals(spec, rng):
        t += gap
        if t >= spec.duration_s:
            break
        app = rng.choices(spec.apps, app_weights)[0]
        adapter = None if rng.random() < spec.base_share else rng.choices(names, weights)[0]
        prompt = rng.randint(*app.frames) * app.tokens_per_frame + rng.randint(*app.text_tokens)
        head = rng.random() < app.head_share
        n_out = 1 if head else rng.randint(*app.output_tokens)
        out.append(RequestView(
            request_id=f"r{len(out):06d}", adapter=adapter, arrival_ms=round(t * 1e3, 3),
            prompt_tokens=prompt, output_tokens=n_out, output_mode="head" if head else "generate",
            app=app.name, slo_ms=app.slo_ms + app.slo_per_token_ms * n_out, priority=app.priority))
    return out


# ---- trace files ------------------------------------------------------------------------------
# image_tokens stays out of the files (and the generator leaves it 0): committed traces are checked by
# the digest of these bytes (bench/serving_traces.py), and the simulator's profile has no vision term
_TRACE_FIELDS = [f.name for f in fields(RequestView)
                 if f.name not in ("computed_tokens", "generated_tokens", "image_tokens")]
_REQUIRED = ("request_id", "arrival_ms", "adapter", "prompt_tokens", "output_tokens")


def write_trace(path: str | Path, requests: Iterable[RequestView], spec: WorkloadSpec | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        header = {"trace": "vlora", "version": TRACE_VERSION, "spec": asdict(spec) if spec else None}
        f.write(json.dumps(header) + "\n")
        for r in requests:
            f.write(json.dumps({k: getattr(r, k) for k in _TRACE_FIELDS}) + "\n")
    return path


def read_trace(path: str | Path) -> list[RequestView]:
    """Requests of a trace file, in arrival order."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from e
            if "trace" in row:
                if row.get("version") != TRACE_VERSION:
                    raise ValueError(f"{where}: trace version {row.get('version')!r}; "
                                     f"this reader knows {TRACE_VERSION}")
                continue
            missing = [k for k in _REQUIRED if k not in row]
            unknown = sorted(set(row) - set(_TRACE_FIELDS))
            if missing or unknown:
                raise ValueError(f"{where}: missing {missing}, unknown {unknown}; fields are {_TRACE_FIELDS} "
                                 f"(required {list(_REQUIRED)})")
            try:
                out.append(RequestView(**row))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: {e}") from e
    ids = [r.request_id for r in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: request_id values must be unique")
    return sorted(out, key=lambda r: (r.arrival_ms, r.request_id))
