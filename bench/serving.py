"""Serving evaluation on the real engine: every orchestrator policy replays generated workloads in real time.

One engine (a zoo model with random weights, or a checkpoint directory) serves `adapters` LoRA
adapters (random PEFT directories of rank `rank` on `targets`, or the given `adapter_dirs`). For
each point of the sweeps (request rate at `base_skewness`, skewness at `base_rate`) a workload
comes from serve.orchestrator's generator (Poisson arrivals, the most requested adapter taking
`skewness` of the requests, the two applications' shapes), then for each policy the same trace is
replayed against `engine.add_request` / `engine.step` by the wall clock: a request enters once its
arrival time has passed, the engine steps whenever it has work. Video-analytics requests carry a
few frames (images of `image_size`) and ask a few tokens; retrieval requests carry one image and a
question and ask tens of tokens (fixed lengths, no early stop).

The policy is swapped on the one engine between runs, the weights brought back to unmerge first.
Each policy runs the operators it names: dLoRA its einsum LoRA (eager) and per-layer addmm
switches as its paper describes, `dlora_atmm` the same rule on ATMM and the one-shot switch, the
others ATMM and the one-shot switch. Latency runs
from the scheduled arrival to the final token. Per (sweep, x, policy) one row: the orchestrator's
metrics (average token latency, p50/p95/p99, throughput, share within target) and the mode
switches with their total time from the engine's stats. Before the replays, decode and prefill
steps are timed plain, unmerged and in mixture (`mode_steps`: how much of unmerge's extra LoRA time
mixture saves). Writes serving.csv, modes.csv, serving.json, latency_vs_<sweep>.png and traces.json
(every point's trace as its seeded spec: bench.serving_traces) under out_dir/<device>/, prints the tables.

    rows, meta = run_serving_bench(ServingBenchJob(policies=("v_lora", "unmerge_only"), rates=(16,)))
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from bench.engine import WORDS, build_random_model
from bench.serving_capacity import measure_capacity, run_order
from bench.serving_replay import LEARNING_COLUMNS, build_requests, replay, use_policy as _use_policy
from bench.serving_traces import record
from bench.serving_stats import learning_note, learning_summary, plot_points, summarize_points, summary_table, verdicts
from serve.orchestrator import POLICIES, Mode, WorkloadSpec, build_policy, generate, video_analytics, \
    visual_retrieval
from serve.sim.evaluate import METRIC_COLUMNS, EvalJob, points
from serve.sim.report import plot
from .results import device_label, results_dir, write_csv, write_json

COLUMNS = ("sweep", "x", "policy", "seed", "rate", "skewness", *METRIC_COLUMNS, "aborted", "steps_unmerge",
           "steps_merge", "steps_mixture", "replay_s", *LEARNING_COLUMNS, "run_order")
SWEEPS = ("rate", "skewness", "load")


@dataclass
class ServingBenchJob:
    model: str = "qwen2_vl_7b"  # zoo spec: random weights of the published shape (unless `checkpoint`)
    checkpoint: str | None = None  # an HF checkpoint directory to serve instead of a zoo build
    dtype: str = "bfloat16"
    device: str = "cuda"
    adapters: int = 8  # random PEFT adapters written (ignored when adapter_dirs are given)
    rank: int = 64
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    adapter_dirs: tuple[str, ...] = ()  # "name=path" or "path": existing PEFT adapters to serve instead
    # names (their default parameters) or conf/orchestrator group dicts ({"name": ..., params})
    policies: tuple = ("v_lora", "unmerge_only", "dlora", "merge_only")
    rates: tuple[float, ...] = (16.0,)  # requests/s; the rate sweep runs at base_skewness
    skewness: tuple[float, ...] = (0.3, 0.6, 0.9)  # the skewness sweep runs at base_rate
    sweeps: tuple[str, ...] = ("skewness",)  # rate | skewness | load
    base_rate: float | None = None  # default: the largest of `rates`
    base_skewness: float | None = None  # default: the middle of `skewness`
    # load sweep: at each skewness, rates at these shares of unmerge-only's capacity (measured first,
    # or capacity_rps when given, or a capacity.json left in the results folder by an earlier run)
    loads: tuple[float, ...] = (0.5, 0.7, 0.85)
    capacity_rps: float | None = None
    capacity_requests: int = 192  # the burst that gives the first estimate
    # "poisson": then Poisson arrivals at capacity_overload x that estimate for capacity_probe_s, the
    # capacity read off their finishes (the workload's arrival process, not a burst's full batches)
    capacity_arrival: str = "poisson"
    capacity_probe_s: float = 8.0
    capacity_overload: float = 1.3
    shuffle_policies: bool = True  # each (point, seed) replays the policies in its own random order
    seeds: tuple[int, ...] = ()  # traces per point (different arrivals and adapters); () = (seed,)
    tag: str = ""  # a subfolder of the device's results folder (e.g. the adapter shape)
    arrival: str = "poisson"
    duration_s: float = 20.0  # arrivals per point
    drain_s: float = 30.0  # after the last arrival, requests still unfinished this long are aborted
    # threads preprocessing arriving requests off the stepping thread, as the RPC server does (0: on it)
    prepare_threads: int = 4
    warmup_s: float = 4.0  # an unmeasured replay per policy first (kernel compiles, autotuning, first shapes)
    # the engine's own warm-up first (GPU: the waves `vlora serve` runs before it is ready), so that a kernel
    # compiled mid-replay is one a server would meet too, and is counted (the row's kernel_compiles)
    engine_warm_up: bool = True
    video_share: float = 0.5
    # video analytics requests answered by the adapter's task head (one prefill), as in the paper's
    # workload; every served adapter then needs a head (random adapters get one)
    video_head_share: float = 0.5
    video_frames: tuple[int, int] = (2, 4)
    video_output_tokens: tuple[int, int] = (4, 8)
    retrieval_output_tokens: tuple[int, int] = (16, 64)
    text_tokens: tuple[int, int] = (16, 48)
    image_size: int = 448  # square frames; Qwen2-VL: (448 / 28)^2 = 256 tokens each
    max_batch_size: int = 32
    max_tokens_per_step: int = 8192
    profile: str = "measure"  # assumed | measure | a CostProfile JSON path
    # mixture saving: steps timed in each mode with these shares of the sequences of other adapters
    mode_other_shares: tuple[float, ...] = (0.125, 0.25, 0.375)
    mode_decode_seqs: int = 32  # a decode step: this many sequences, one token each
    mode_prefill: tuple[int, int] = (8, 2048)  # a prefill step: (sequences, tokens)
    seed: int = 0
    out_dir: str = "results/serving"

    def __post_init__(self) -> None:
        for name in ("loads", "seeds"):
            value = getattr(self, name)
            setattr(self, name, (value,) if isinstance(value, (int, float)) else tuple(value))
        bad = sorted(set(self.sweeps) - set(SWEEPS))
        if bad or not self.sweeps:
            raise ValueError(f"sweeps {list(self.sweeps)}: give one or more of {SWEEPS}")
        if "load" in self.sweeps and (not self.loads or any(not 0 < x <= 2 for x in self.loads)):
            raise ValueError(f"loads {list(self.loads)}: shares of capacity in (0, 2] for the load sweep")
        if self.capacity_requests < 10:
            raise ValueError(f"capacity_requests must be >= 10, got {self.capacity_requests}")
        if self.capacity_arrival not in ("burst", "poisson"):
            raise ValueError(f"capacity_arrival must be 'burst' or 'poisson', got {self.capacity_arrival!r}")
        if self.capacity_arrival == "poisson" and (self.capacity_probe_s <= 0 or self.capacity_overload <= 1):
            raise ValueError(f"capacity_probe_s must be > 0 and capacity_overload > 1, got {self.capacity_probe_s}, "
                             f"{self.capacity_overload}")
        if not self.policies or not self.rates or not self.skewness:
            raise ValueError("policies, rates and skewness must each hold at least one value")
        for name in ("targets", "adapter_dirs", "rates", "skewness", "sweeps", "policies"):
            value = getattr(self, name)
            setattr(self, name, (value,) if isinstance(value, str) else tuple(value))

        if not 0 <= self.video_head_share <= 1:
            raise ValueError(f"video_head_share must be in [0, 1], got {self.video_head_share}")
        self.policy_params()  # names checked now, not after the model is built

    def policy_params(self) -> dict[str, dict]:
        """policy name -> its parameters, in the order given."""
        out = {}
        for p in self.policies:
            params = dict(p) if isinstance(p, dict) else {"name": p}
            name = params.pop("name", None)
            if name not in POLICIES or name in out:
                raise ValueError(f"policies: {name!r} is unknown or given twice; valid: {sorted(POLICIES)}")
            out[name] = params
        return out

    def workload(self) -> WorkloadSpec:
        tokens_per_frame = max(1, (self.image_size // 28) ** 2)  # Qwen2-VL: 14-pixel patches, 2x2 merged
        video = dataclasses.replace(video_analytics(self.video_share), frames=self.video_frames,
                                    head_share=self.video_head_share,
                                    output_tokens=self.video_output_tokens, tokens_per_frame=tokens_per_frame,
                                    text_tokens=self.text_tokens)
        retrieval = dataclasses.replace(visual_retrieval(1 - self.video_share), tokens_per_frame=tokens_per_frame,
                                        output_tokens=self.retrieval_output_tokens, text_tokens=self.text_tokens)
        return WorkloadSpec(rate=self.base_rate or max(self.rates), duration_s=self.duration_s, arrival=self.arrival,
                            num_adapters=len(self.adapter_dirs) or self.adapters,
                            skewness=self.base_skewness or self.skewness[len(self.skewness) // 2],
                            apps=[video, retrieval], seed=self.seed)


def random_weights(job: ServingBenchJob, workdir: Path, device: str | None = None) -> dict:
    """The zoo model's random weights (the same for the same seed), built on `device` (default the
    job's), its config and processor written to workdir."""
    hf, _ = build_random_model(job.model, job.seed, job.dtype, device or job.device, workdir)
    weights = dict(hf.state_dict())
    del hf
    return weights


def engine_plan(job: ServingBenchJob, workdir: Path, first_policy: tuple[str, dict]):
    """(checkpoint directory, EngineConfig, adapter names) of the engine the job serves, weights
    not built: a zoo model's config is written to workdir (its weights come from `random_weights`
    where the engine runs), the adapters are written (or taken from adapter_dirs). The names are in
    the order the workload's adapter-000, adapter-001, ... stand for."""
    from serve.engine import EngineConfig

    ckpt = Path(job.checkpoint) if job.checkpoint else workdir
    if job.checkpoint is None:
        random_weights(job, workdir, device="meta")  # config and processor only
    dirs = [d.partition("=")[::2] if "=" in d else (Path(d).name, d) for d in job.adapter_dirs]
    if not dirs:
        from bench.adapter_parts import write_peft_adapter
        from serve.models import read_model_args

        args, dtype = read_model_args(ckpt)[0], getattr(torch, job.dtype) if job.dtype != "auto" else torch.float32
        dirs = [(f"a{i}", write_peft_adapter(workdir / "adapters" / f"a{i}", args, job.rank, job.targets, 1000 + i,
                                             dtype, job.device)) for i in range(job.adapters)]
        if job.video_head_share > 0:
            from bench.adapters import write_head

            for _, path in dirs:
                write_head(Path(path), args.hidden_size)
    elif job.video_head_share > 0:
        headless = [name for name, path in dirs if not (Path(path) / "heads").is_dir()]
        if headless:
            raise ValueError(f"adapters {headless} have no task head (heads/<domain>/) for the head-mode video "
                             "requests: give adapters with heads or set video_head_share=0")
    spec = job.workload()
    per_seq = (job.video_frames[1] * spec.apps[0].tokens_per_frame + job.text_tokens[1] + 128
               + max(job.video_output_tokens[1], job.retrieval_output_tokens[1]))
    name, params = first_policy
    config = EngineConfig(device=job.device, dtype=job.dtype, max_batch_size=job.max_batch_size,
                          max_tokens_per_step=job.max_tokens_per_step, seed=job.seed,
                          num_kv_blocks=2 * job.max_batch_size * per_seq // 16 + 64 if job.device != "cpu" else None,
                          adapter_slots=len(dirs), host_adapter_cache=len(dirs) + 4, max_lora_rank=job.rank,
                          lora_targets=job.targets, adapters=tuple(f"{n}={p}" for n, p in dirs), profile=job.profile,
                          policy=name if name != "fcfs" else "v_lora", policy_params=params if name != "fcfs" else {})
    return ckpt, config, [n for n, _ in dirs]


def serving_engine(job: ServingBenchJob, workdir: Path, first_policy: tuple[str, dict]):
    """The engine with the adapters loaded at start (profile="measure" times them) and their names."""
    from serve.engine import Engine

    ckpt, config, names = engine_plan(job, workdir, first_policy)
    weights = None if job.checkpoint else random_weights(job, workdir)
    return Engine(ckpt, config, weights=weights), names


def _warm_up(engine, job: ServingBenchJob, names: list[str]) -> None:
    """Compiles kernels and captures graphs outside the timed runs: a few requests, a switch each way."""
    rng = np.random.default_rng(10**6)
    engine.planner.apply(Mode.merge(names[0]))
    engine.planner.apply(Mode.unmerge())
    from serve.engine import Request, SamplingParams

    params = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False)
    image = rng.integers(0, 256, (job.image_size, job.image_size, 3), dtype=np.uint8)
    engine.generate([Request(prompt=" ".join(WORDS[:8]), images=[image], adapter=a, sampling=params)
                     for a in [names[0], names[-1], None]])


def mode_steps(engine, job: ServingBenchJob) -> list[dict]:
    """Decode and prefill steps timed plain, unmerged and in mixture at each share of other adapters'
    sequences; `saving` is the share of unmerge's extra LoRA time that mixture does not spend."""
    from serve.engine.step_costs import time_mode_steps

    rows = []
    shapes = (("decode", job.mode_decode_seqs, job.mode_decode_seqs), ("prefill", *job.mode_prefill))
    for kind, seqs, tokens in shapes:
        for share in job.mode_other_shares:
            n_other = max(1, round(share * seqs))
            t = time_mode_steps(engine.runner, engine.lora, seqs, tokens, n_other * (tokens // seqs),
                                min(4, len(engine.lora.records)))
            extra_unmerge, extra_mixture = t["unmerge"] - t["plain"], t["mixture"] - t["plain"]
            rows.append(dict(step=kind, seqs=seqs, tokens=tokens, other_seqs=n_other, plain_ms=t["plain"],
                             unmerge_ms=t["unmerge"], mixture_ms=t["mixture"],
                             saving=1 - extra_mixture / extra_unmerge if extra_unmerge > 0 else float("nan")))
            r = rows[-1]
            print(f"modes {kind} {seqs}x{tokens // seqs}, {n_other} of other adapters: plain {r['plain_ms']:.3f} "
                  f"unmerge {r['unmerge_ms']:.3f} mixture {r['mixture_ms']:.3f} ms, saving {r['saving']:.2f}",
                  file=sys.stderr, flush=True)
    return rows


def _points(job: ServingBenchJob, capacity: float | None) -> list[tuple[str, float, WorkloadSpec]]:
    """(sweep, x, workload) of every point: the rate and skewness sweeps as in the simulator, the
    load sweep as every (skewness, share of capacity) pair."""
    spec = job.workload()
    evaljob = EvalJob(policies=job.policy_params(), workload=spec, rates=list(job.rates), skewness=list(job.skewness),
                      sweeps=[w for w in job.sweeps if w != "load"], max_batch_size=job.max_batch_size)
    todo = points(evaljob) if evaljob.sweeps else []
    if "load" in job.sweeps:
        todo += [("load", load, dataclasses.replace(spec, rate=load * capacity, skewness=skew))
                 for skew in job.skewness for load in job.loads]
    return todo


def _done_rows(path: Path) -> dict[tuple, dict]:
    """Rows of an earlier run of the same folder, by (sweep, x, skewness, policy, seed): a rerun
    replays only the rest (a device call may end before every point is done)."""
    if not path.is_file():
        return {}
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    out = {}
    for r in rows:
        for k in COLUMNS:
            if k not in ("sweep", "policy", "slowest_step_mode") and r.get(k, "") != "":
                r[k] = float(r[k]) if any(c in r[k] for c in ".en") else int(r[k])
        out[(r["sweep"], float(r["x"]), float(r["skewness"]), r["policy"], int(r["seed"]))] = r
    return out


def run_serving_bench(job: ServingBenchJob) -> tuple[list[dict], dict]:
    """Runs every (point, seed, policy) not already in the folder's serving.csv; writes CSV / JSON /
    plots under out_dir/<device>[/tag]/ and returns (rows, meta)."""
    if job.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("device=cuda asked for but no CUDA device is available; use device=cpu with a tiny model")
    gpu = device_label(job.device)
    out = results_dir(job.out_dir, gpu) / job.tag if job.tag else results_dir(job.out_dir, gpu)
    out.mkdir(parents=True, exist_ok=True)
    policies = job.policy_params()
    seeds = job.seeds or (job.seed,)
    first = next(((n, p) for n, p in policies.items() if n != "fcfs"), ("fcfs", {}))
    workdir = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    t0 = time.perf_counter()
    engine, names = serving_engine(job, workdir, first)
    load_s = time.perf_counter() - t0
    engine.cost_profile.save(out / "profile.json")
    if job.engine_warm_up and engine.needs_warm_up:
        engine.warm_up(side=job.image_size, frames=job.video_frames[1])
    _warm_up(engine, job, names)
    modes = mode_steps(engine, job) if job.mode_other_shares else []
    if modes:  # now, not with the replays' files: a run cut short keeps them
        write_csv(out / "modes.csv", modes)
    capacity = None
    if "load" in job.sweeps:
        saved = out / "capacity.json"
        if job.capacity_rps is not None:
            capacity = dict(capacity_rps=job.capacity_rps, given=True)
        elif saved.is_file():
            capacity = json.loads(saved.read_text())
        else:
            capacity = measure_capacity(engine, job, names, out)
    todo = _points(job, capacity["capacity_rps"] if capacity else None)
    done = _done_rows(out / "serving.csv")
    if job.warmup_s > 0:
        warm = generate(dataclasses.replace(todo[0][2], duration_s=job.warmup_s, seed=job.seed + 10**6))
        warm_requests = build_requests(warm, names, job.image_size, job.seed + 10**6, sum(job.text_tokens) // 2,
                                       job.video_frames[1])
        for name, params in policies.items():
            _use_policy(engine, name, params)
            replay(engine, warm, warm_requests, job.drain_s, job.prepare_threads)
    rows = []
    n = len(todo) * len(seeds) * len(policies)
    for sweep, x, point in todo:
        for seed in seeds:
            spec = dataclasses.replace(point, seed=seed)
            trace = requests = None
            order = run_order(list(policies), sweep, x, spec.skewness, seed, job.shuffle_policies)
            for name in order:
                params = policies[name]
                key = (sweep, float(x), float(spec.skewness), name, int(seed))
                if key not in done:
                    if trace is None:
                        trace = generate(spec)
                        # the seeded spec, not the JSONL: bench.serving_traces rebuilds the file
                        record(out, f"trace_{sweep}_{x:g}_skew{spec.skewness:g}_seed{seed}.jsonl", spec)
                        requests = build_requests(trace, names, job.image_size, seed, sum(job.text_tokens) // 2,
                                                  job.video_frames[1])
                    _use_policy(engine, name, params)
                    m, extra = replay(engine, trace, requests, job.drain_s, job.prepare_threads, log_path=out /
                                      "decisions" / f"{sweep}_{x:g}_skew{spec.skewness:g}_seed{seed}_{name}.json")
                    engine.planner.apply(Mode.unmerge())
                    done[key] = {"sweep": sweep, "x": x, "policy": name, "seed": seed, "rate": spec.rate,
                                 "skewness": spec.skewness, **{k: m[k] for k in METRIC_COLUMNS}, **extra,
                                 "run_order": order.index(name)}
                    write_csv(out / "serving.csv", done.values(), COLUMNS)  # after every replay: resumable
                row = done[key]
                at = len(rows) + order.index(name) + 1
                print(f"[{at}/{n}] {sweep}={x:g} skew={spec.skewness:g} seed={seed} {name}: "
                      f"{row['avg_token_latency_ms']:.2f} ms/token, p95 {row['p95_ms']:.0f} ms, "
                      f"{row['completed']}/{row['requests']} done, {row['switches']} switches "
                      f"({row['switch_ms']:.1f} ms){learning_note(row)}", file=sys.stderr, flush=True)
            # reported in the policies' given order, whatever order they ran in
            rows += [done[(sweep, float(x), float(spec.skewness), name, int(seed))] for name in policies]
    meta = dict(device=gpu, date=time.strftime("%Y-%m-%d"), engine_load_s=load_s, adapters=names, modes=modes,
                capacity=capacity, seeds=list(seeds), profile=engine.cost_profile.to_dict(), torch=torch.__version__,
                transformers=__import__("transformers").__version__, job=dataclasses.asdict(job))
    profile = engine.cost_profile
    del engine
    gc.collect()
    # every row of the folder, each (point, seed)'s policies in the order given (they ran shuffled)
    rank = {name: i for i, name in enumerate(policies)}
    groups = {k[:3] + k[4:]: i for i, k in enumerate(done)}
    _write([done[k] for k in sorted(done, key=lambda k: (groups[k[:3] + k[4:]], rank.get(k[3], len(rank))))],
           meta, out, profile)
    return rows, meta


def _write(rows: list[dict], meta: dict, out: Path, profile) -> None:
    """Every row of the folder (this run's and earlier ones'): the CSV, the summary over seeds with
    95% intervals and the verdicts against the fixed policies, plots, tables."""
    if meta["modes"]:
        write_csv(out / "modes.csv", meta["modes"])
    write_csv(out / "serving.csv", rows, COLUMNS)
    summary = summarize_points(rows)
    write_csv(out / "summary.csv", summary)
    checks = verdicts(summary)
    if checks:
        write_csv(out / "verdicts.csv", checks)
    learnt = learning_summary(rows)
    write_json(out / "serving.json", {"meta": meta, "rows": rows, "summary": summary, "verdicts": checks,
                                      "learning": learnt})
    single = [r for r in rows if r["sweep"] != "load"]
    meta["plots"] = [str(p) for p in plot(single, profile, out)] if single else []
    meta["plots"] += [str(p) for p in plot_points(summary, out, f"{meta['device']}, {', '.join(meta['job']['targets'])}"
                                                                 f" rank {meta['job']['rank']}")]
    print(summary_table(summary))
    for c in checks:
        print(f"{c['sweep']}={c['x']:g} skew={c['skewness']:g}: v_lora / best fixed ({c['best_fixed']}) "
              f"{c['ratio_best']:.3f}{'' if c['within_5pct'] else ' (over 5%)'}, / unmerge-only "
              f"{c['ratio_unmerge']:.3f}{'' if c['overlap'] else ' (intervals apart)'}")
    for s in learnt:
        print(f"{s['policy']}: learnt step cost within {100 * s['pred_err_median']:.1f}% of measured (median over "
              f"{s['replays']} replays' medians; {100 * s['within_15pct']:.0f}% of replays within 15%), guard fell "
              f"back {s['guard_engaged']} times for {s['guard_fallback_steps']} steps")
