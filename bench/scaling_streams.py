"""The scaling suite's streams workload: cameras with heads on one GPU, on replicas of one host, and on a
model split over several GPUs.

    vlora bench bench.suite=scaling bench.scaling.workload=streams bench.scaling.streams.gpus=[2]

Each setup serves the streams evaluation's engine (a 7B-shaped Qwen2-VL, random weights, `adapters`
random LoRA adapters each with a classification head) behind the RPyC front end, and cameras (one
chunk a second each, head answers) run the streams search on it: `stream_counts` cameras per GPU
times the setup's GPUs, upwards until one misses the target (p95 > target_ms, an error or an
unanswered chunk), then `refine` bisection steps. A setup's answer is its largest passing count.

    single     one engine in this process (GPU 0), as `vlora serve` runs it
    replicas   N Ray Serve replicas on N GPUs (one each) behind ReplicatedEngine, as
               `vlora serve replicas.count=N` fronts them; adapters load on a replica's first
               request for them and Ray's router keeps sending an adapter to the replica that holds it
    tp         one tensor-parallel group of `tp_size` GPUs (a LocalGroup; random weights drawn on each
               rank, its shard only: a model one GPU cannot hold, e.g. qwen2_vl_72b), searched with
               `stream_counts` per group, then one chunk and a decode step profiled on rank 0 for the
               share of communication (bench.scaling_streams_tp)

Scaling efficiency = cameras(N) / (N x cameras(single)). Rows also carry the chunks each replica
answered and its adapter loads (affinity: each adapter loaded once, by one replica while it has room).

The kill point (bench.scaling_streams_point): on the replicas setup of the most GPUs, `kill_cameras`
cameras (default `kill_share` of its measured cameras) run `kill_seconds`; `kill_after_s` in, the
busiest replica's process is killed; the front end sends that replica's requests again. Reported:
chunks lost, per-second p95 around the kill, the spike and the time to recover. Note that past half
of two replicas' capacity the survivor alone is overloaded until Ray Serve's replacement replica is up,
so the recovery time there includes that replica's start.

Every setup's rows are saved as measured, after each point (streams_<setup>_<gpus>.json), and a setup
saved whole for the same model is not run again unless fresh=true; past `budget_s` from the start no
point starts (a search cut there keeps its points); the report (streams_scaling.csv/.json/.md,
streams_kill.csv) is written from whatever is saved.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .results import device_label, results_dir, write_json
from .scaling_streams_report import measured_cameras, report, saved_whole
from .streams import StreamsBenchJob, _log, render_chunks, search
from .streams_hf import chunk_flops

SETUPS = ("single", "replicas", "tp")
APP = "vlora-scaling-streams"


@dataclass
class ScalingStreamsJob(StreamsBenchJob):
    setups: tuple[str, ...] = SETUPS
    gpus: tuple[int, ...] = (2,)  # GPU counts of the replicas setup (one replica a GPU), rising
    stream_counts: tuple[int, ...] = (16, 20, 24, 28, 32, 36, 40)  # cameras per GPU, rising
    modes: tuple[str, ...] = ("head",)
    kill_cameras: int | None = None  # the kill point's cameras; None: kill_share x measured; 0: no kill point
    kill_share: float = 0.8
    kill_after_s: float = 5.0  # from the cameras' start to the kill
    kill_seconds: float = 90.0  # the kill point's measured seconds: long enough for a replacement replica to start
    kill_drain_s: float = 60.0  # the kill point's chunks count as lost only this long after a stream's last send
    replica_capacity: int | None = None  # requests a replica takes at once (default max_batch_size)
    tp_size: int = 2  # the tp setup's GPUs: one tensor-parallel group
    step_profile: bool = True  # the tp setup: one chunk and a decode step profiled on rank 0 after the search
    budget_s: float | None = None  # seconds from the start after which no point starts (None: no limit)
    fresh: bool = False
    engine_only: bool = False
    hf_baseline: bool = False
    fresh_caches: bool = False

    def __post_init__(self) -> None:
        self.setups = (self.setups,) if isinstance(self.setups, str) else tuple(self.setups)
        self.gpus = (self.gpus,) if isinstance(self.gpus, int) else tuple(self.gpus)
        super().__post_init__()
        bad = [s for s in self.setups if s not in SETUPS]
        if bad or not self.setups:
            raise ValueError(f"setups {list(self.setups)}: give some of {list(SETUPS)}")
        if self.modes != ("head",):
            raise ValueError(f"modes {list(self.modes)}: the scaling streams workload runs the cameras' heads only")
        if not self.gpus or list(self.gpus) != sorted(set(self.gpus)) or min(self.gpus) < 1:
            raise ValueError(f"gpus {list(self.gpus)}: the replicas setup's GPU counts, rising and positive")
        if not 0 < self.kill_share <= 1 or (self.kill_cameras is not None and self.kill_cameras < 0):
            raise ValueError(f"kill_share ({self.kill_share}) must be in (0, 1] and kill_cameras "
                             f"({self.kill_cameras}) null or >= 0")
        if not 0 < self.kill_after_s <= self.kill_seconds - 2 or self.kill_drain_s < 0:
            raise ValueError(f"kill_after_s ({self.kill_after_s}) must be positive and leave at least 2 of "
                             f"kill_seconds ({self.kill_seconds}) after the kill; kill_drain_s >= 0")
        if self.kill_cameras and "replicas" not in self.setups:
            raise ValueError(f"kill_cameras={self.kill_cameras}: the kill point needs the replicas setup")
        if "replicas" in self.setups and importlib.util.find_spec("ray") is None:
            raise ValueError('setup replicas needs Ray Serve: pip install -e ".[ray]"')
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 2:
            raise ValueError(f"tp_size {self.tp_size!r}: the tp setup's GPUs, 2 or more")
        if self.budget_s is not None and not self.budget_s > 0:
            raise ValueError(f"budget_s {self.budget_s!r}: positive seconds, or null for no limit")

    def runs(self) -> list[tuple[str, int]]:
        """(setup, GPUs) in the order they run; "kill": the kill point, on the most GPUs (two or more)."""
        replicas = [("replicas", g) for g in self.gpus] if "replicas" in self.setups else []
        kill = [("kill", self.gpus[-1])] if replicas and self.kill_cameras != 0 and self.gpus[-1] > 1 else []
        tp = [("tp", self.tp_size)] if "tp" in self.setups else []
        return ([("single", 1)] if "single" in self.setups else []) + tp + replicas + kill


def streams_job(workload: str, values: dict, out_dir: str) -> ScalingStreamsJob:
    """The job of bench.scaling.workload=streams from bench.scaling.streams' options."""
    if workload != "streams":
        raise ValueError(f"bench.scaling.workload={workload!r}: give serving or streams")
    known = {f.name for f in dataclasses.fields(ScalingStreamsJob)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"bench.scaling.streams has no option(s) {unknown}; valid: {sorted(known)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return ScalingStreamsJob(**{**values, "out_dir": out_dir})


def run_streams_scaling(job: ScalingStreamsJob) -> tuple[list[dict], dict]:
    """Runs the setups not yet saved, then writes the report; returns (rows, summary)."""
    from zoo import get_spec

    spec = get_spec(job.model)
    if spec.arch not in ("qwen2_vl", "qwen2_5_vl"):
        raise ValueError(f"model {job.model!r}: cameras send video chunks, which only the Qwen2-VL / Qwen2.5-VL "
                         "zoo models take")
    if "tp" in job.setups:
        from serve.models.parallel import check_divisible

        try:
            check_divisible(spec.text, job.tp_size)
        except ValueError as e:
            raise ValueError(f"tp_size={job.tp_size} does not split {job.model}: {e}") from None
    if job.device.startswith("cuda"):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need = max(g for _, g in job.runs())
        if have < need:
            raise RuntimeError(f"setups {job.runs()} need {need} GPU(s); this machine has {have}")
    out = results_dir(job.out_dir, device_label(job.device))
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="scaling-streams-"))
    deadline = time.monotonic() + job.budget_s if job.budget_s else None
    plan = deployments = None
    try:
        for setup, gpus in job.runs():
            path = out / f"streams_{setup}_{gpus}.json"
            if saved_whole(path, job.model) and not job.fresh:
                _log(f"{setup} ({gpus} GPU): measured already ({path}); fresh=true measures again")
                continue
            plan = plan or _plan(job, workdir, deadline)
            meta = dict(setup=setup, gpus=gpus, model=job.model, tp=gpus if setup == "tp" else 1,
                        device=device_label(job.device), date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                        job=dataclasses.asdict(job))
            t0 = time.perf_counter()

            def save(rows: list[dict], whole: bool = False) -> None:  # after every point: a cut run keeps them
                write_json(path, {"meta": {**meta, "wall_s": time.perf_counter() - t0, "complete": whole},
                                  "rows": rows})

            if setup == "single":
                rows = _single(job, plan, gpus, meta, save)
            elif setup == "tp":
                from .scaling_streams_tp import run_tp

                rows = run_tp(job, plan, gpus, meta, save)
            else:
                from .scaling_streams_replicas import Deployments, run_kill, run_replicas

                deployments = deployments or Deployments(job, plan)
                rows = (run_replicas(job, deployments, gpus, meta, save) if setup == "replicas" else
                        run_kill(job, deployments, gpus, meta, measured_cameras(out / f"streams_replicas_{gpus}.json")))
            save(rows, whole=True)
            gc.collect()  # the next setup's engines size their K/V caches from the GPU memory left free
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        if deployments is not None:
            deployments.close()
    return report(job, out)


@dataclass
class _Plan:
    workdir: Path
    config: dict  # EngineConfig's fields, adapters loaded at start left out
    adapters: dict[str, str]  # name -> PEFT directory (with a head)
    chunks: list
    deadline: float | None = None  # time.monotonic() past which no point starts (job.budget_s)
    prompt_tokens: int = 0  # of one chunk's request


def _plan(job: ScalingStreamsJob, workdir: Path, deadline: float | None = None) -> _Plan:
    """The checkpoint folder (config and processor; weights are made where each engine runs), the
    adapters with heads, the rendered chunks and the engine config of bench.streams' engine."""
    from bench.adapter_parts import write_peft_adapter
    from bench.adapters import write_head
    from bench.engine import build_random_model
    from serve.models import read_model_args

    hf, processor = build_random_model(job.model, job.seed, job.dtype, "meta", workdir)
    chunks = render_chunks(job)
    prompt_tokens = chunk_flops(hf, processor, job, chunks[0])["prompt_tokens"]
    del hf
    args = read_model_args(workdir)[0]
    adapters = {}
    for i in range(job.adapters):
        path = write_peft_adapter(workdir / "adapters" / f"a{i}", args, job.rank, job.targets, 1000 + i,
                                  getattr(torch, job.dtype), "cpu")
        write_head(path, args.hidden_size)
        adapters[f"a{i}"] = str(path)
    per_seq = prompt_tokens + job.answer_tokens + 32
    cuda = job.device.startswith("cuda")
    # as bench.streams' engine (one GPU's K/V sized for a full batch of chunks)
    config = dict(device="cuda" if cuda else job.device, dtype=job.dtype, max_batch_size=job.max_batch_size,
                  max_tokens_per_step=job.max_tokens_per_step, seed=job.seed, encode_ahead=job.encode_ahead,
                  warm_up="on" if job.engine_warm_up else "off", max_prefill_with_decode=job.max_prefill_with_decode,
                  num_kv_blocks=2 * job.max_batch_size * per_seq // 16 + 64 if cuda else None,
                  graph_batch_sizes=tuple(sorted({1, 2, 4, 8, 16, 24, 32, 48, 64, job.max_batch_size})),
                  adapter_slots=job.adapters, host_adapter_cache=job.adapters + 4, max_lora_rank=job.rank,
                  lora_targets=tuple(job.targets), policy=job.policy, policy_params=job.policy_params,
                  quantization=job.quantization)
    return _Plan(workdir, config, adapters, chunks, deadline, prompt_tokens)


def _weights(model: str, seed: int, dtype: str, workdir: str, device: str) -> tuple[str, dict]:
    """Runs where an engine runs (a replica: on its own GPU): the zoo model's random weights, the same
    for the same seed; the checkpoint folder is the plan's."""
    from bench.engine import build_random_model

    hf, _ = build_random_model(model, seed, dtype, device, Path(workdir) / f"rank-{os.getpid()}")
    return workdir, dict(hf.state_dict())


def _threads(job: ScalingStreamsJob) -> int:
    """torch threads of one engine process: its share of the host's cores at the most GPUs."""
    return max(1, (os.cpu_count() or 1) // max(job.gpus))


class _OutOfTime(Exception):
    """The run's budget_s is spent: no further point starts."""


def _search(engine, job: ScalingStreamsJob, plan: _Plan, setup: str, gpus: int, save=None) -> list[dict]:
    """The camera search: stream_counts per GPU times `gpus` (tp: the counts as they are, for one group
    however many GPUs it spans); save(rows) after every point; none starts past plan.deadline."""
    from .scaling_streams_point import run_scaling_point

    names = list(plan.adapters)
    tp = gpus if setup == "tp" else 1
    counts = tuple(n * (gpus // tp) for n in job.stream_counts)  # per GPU, or per group of tp GPUs
    rows: list[dict] = []

    def point(n: int) -> dict:
        if plan.deadline is not None and time.monotonic() > plan.deadline:
            raise _OutOfTime
        rows.append({"setup": setup, "gpus": gpus, "model": job.model, "tp": tp,
                     **run_scaling_point(engine, job, n, plan.chunks, names)})
        if save is not None:
            save(sorted(rows, key=lambda r: r["streams"]))
        return rows[-1]

    if job.warmup_point_s > 0:  # compiles, graph shapes, a replica's adapter loads: not measured
        run_scaling_point(engine, job, counts[0], plan.chunks, names, seconds=job.warmup_point_s)
    try:
        search(point, counts, job.refine)
    except _OutOfTime:
        _log(f"{setup}: budget_s={job.budget_s:g} spent; the search ends after {len(rows)} point(s)")
    return sorted(rows, key=lambda r: r["streams"])


def _single(job: ScalingStreamsJob, plan: _Plan, gpus: int, meta: dict, save=None) -> list[dict]:
    from serve.engine import Engine, EngineConfig

    torch.set_num_threads(_threads(job))
    config = EngineConfig(**plan.config, adapters=tuple(f"{n}={p}" for n, p in plan.adapters.items()))
    t0 = time.perf_counter()
    checkpoint, weights = _weights(job.model, job.seed, job.dtype, str(plan.workdir), config.device)
    engine = Engine(checkpoint, config, weights=weights)
    del weights
    if engine.needs_warm_up:  # as vlora serve does before it serves
        engine.warm_up(side=job.image_size, frames=job.frames_per_chunk)
    meta["load_s"] = time.perf_counter() - t0
    return _search(engine, job, plan, "single", 1, save=save)
