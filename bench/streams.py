"""Streams evaluation: how many cameras one GPU serves within a latency target, through the real server.

Each of N synthetic camera streams sends one video chunk per second (`frames_per_chunk` frames of
`image_size`^2 from the synthetic world's camera, sampled at `frames_per_chunk` fps) to the RPyC
server on loopback, which runs the engine on a 7B-shaped zoo model with random weights and
`adapters` random rank-`rank` LoRA adapters, each with a classification head. Streams are given
adapters round-robin and start staggered over the first second, so arrivals are spread. A
chunk's latency runs from just before its submission (frames encoding, RPC, preprocessing
included) to the moment its client holds the result. Modes: "head" (the adapter's head answers
after one prefill) and "generate" (the LM head decodes exactly `answer_tokens` tokens).

Search, per mode: the `stream_counts` in increasing order until one misses the target
(p95 > target_ms, an error, a chunk left unanswered `drain_s` after the last send, or a latency
trend that would carry the p95 past the target within `sustain_s`: a server just below the offered
rate passes a short window with its backlog growing), then
`refine` bisection steps between the last passing and the first failing count. The largest
passing count is the mode's answer.

Compute efficiency (bench_streams_hf.py): FLOPs per chunk from parameter counts,
`2 * P_lm * (prompt_tokens + generated - 1) + 2 * P_head * generated + 2 * P_vision * patches`
(generated = 0 in head mode), times the chunks/s achieved at the largest passing count, over the
dense matmul rate measured in the same run. The transformers baseline runs `generate` on the same
chunks, `hf_batch` at a time.

    rows, meta = run_streams_bench(StreamsBenchJob(stream_counts=(16, 32, 48)))
    # writes streams.csv / streams.json / streams.png under out_dir/<device>/
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from .results import device_label, results_dir
from .streams_load import _log

MODES = ("head", "generate")


def _counts(values) -> bool:
    """Whether every value is a positive int (a count of cameras; True and False are not counts)."""
    return all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in values)


@dataclass
class StreamsBenchJob:
    model: str = "qwen2_vl_7b"  # zoo spec (Qwen2-VL / Qwen2.5-VL: video input), random weights
    device: str = "cuda"
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    frames_per_chunk: int = 6
    image_size: int = 448  # square frames; Qwen2-VL-7B: 6 frames -> 3 x 16 x 16 = 768 visual tokens
    answer_tokens: int = 8  # generate mode: fixed length (ignore_eos)
    prompt: str = "How many vehicles are in this clip?"
    stream_counts: tuple[int, ...] = (8, 16, 24, 32, 40, 48, 64)
    refine: int = 2  # bisection steps between the last passing and the first failing count
    seconds: float = 10.0  # measured seconds per point
    warmup_s: float = 1.0  # chunks sent in a point's first seconds are not measured
    drain_s: float = 5.0  # after the last send, chunks unanswered this long count as failures
    target_ms: float = 1000.0  # p95 chunk latency a point must meet
    # ... and still meet after this many seconds at the latency trend its window shows (0: the window alone)
    sustain_s: float = 60.0
    modes: tuple[str, ...] = MODES
    adapters: int = 4  # random PEFT adapters, each with a classification head
    rank: int = 16
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    policy: str = "fcfs"  # serve.orchestrator policy of the engine
    policy_params: dict | None = None
    # frames on the wire: jpeg (what cameras send; ~6 ms to encode a 448^2 chunk), raw (no codec, but
    # RPyC zlib-compresses every message over 3 kB: ~60 ms of CPU per 3.6 MB chunk) or png
    encoding: str = "jpeg"
    chunk_pool: int = 32  # distinct rendered chunks; every send is made unique (see bench_streams_load)
    # static cameras: each pooled chunk is one still frame repeated (the unique stamp still changes
    # its first frame), so its later frame groups repeat and the encoder cache can skip them
    static_camera: bool = False
    max_batch_size: int = 64
    max_tokens_per_step: int = 8192
    max_prefill_with_decode: int | None = None  # EngineConfig's: prompt tokens per step while anyone decodes
    engine_only: bool = True  # also the workload on the engine in process (bench/streams_engine.py)
    engine_only_rates: tuple[float, ...] = (20.0, 30.0, 40.0)  # paced in-process arrivals, chunks/s
    warmup_point_s: float = 3.0  # an unmeasured point per mode first (kernel compiles, graph shapes)
    engine_warm_up: bool = True  # the engine's own warm-up before it is ready (vlora serve's default on a GPU)
    # the engine's step loop in a process of its own, as `vlora serve` runs it (rpc.engine_process, its
    # default); false: on a thread of the server's process (rpc.engine_process=false), whose connection
    # threads then share the step loop's interpreter (bench/streams_served.py)
    engine_process: bool = True
    # Triton's and Inductor's on-disk caches in empty folders, as on a fresh machine: without it a
    # second run finds every kernel compiled by the first and no cold start is measured
    fresh_caches: bool = True
    cold_streams: int = 0  # > 0: a point of this many streams right after the engine is ready, before any other
    cold_seconds: float = 10.0  # the cold point's measured seconds, from its first chunk
    # counts measured as the cold point is (from their first chunk, cold_seconds long) but on the warmed server after
    # the search (point "ramp"): what N cameras starting at once cost a warm server, which the cold point is read beside
    ramp_counts: tuple[int, ...] = ()
    # > 0: the cold point's and the first ramp's first steps run under torch.profiler in the engine (host operators and
    # CUDA runtime calls by self CPU time, row `step_profiles`): what a cold first step does that a warm one does not
    profile_first_steps: int = 0
    # warm counts measured again after the search with the engine's encode_ahead off (an A/B in one run)
    ahead_off_counts: tuple[int, ...] = ()
    # warm counts measured again after the search for window_seconds each (point "window"): whether a count
    # that passes in the short points holds over a long window, where a slow backlog would show
    window_counts: tuple[int, ...] = ()
    window_seconds: float = 60.0
    encode_ahead: str = "auto"  # EngineConfig's (auto: on a GPU)
    quantization: str = "none"  # EngineConfig's: none (the checkpoint's dtype) or fp8 projections (serve/models/fp8.py)
    hf_baseline: bool = True
    hf_batch: int = 8
    hf_batches: int = 4  # timed batches (after one warm-up batch)
    matmul_n: int = 8192  # side of the timed square matmul (cpu: at most 1024)
    # GPU: the same matmul back to back for this long at the end, its rate once the clocks have settled under
    # full load (a GPU at its power limit clocks down): the compute floor at that rate beside the burst one (0: off)
    matmul_sustained_s: float = 20.0
    seed: int = 0
    out_dir: str = "results/streams"
    command: str | None = None  # recorded in the JSON; default: this process's command line

    def __post_init__(self) -> None:
        for name in ("stream_counts", "modes", "targets", "ahead_off_counts", "window_counts", "ramp_counts"):
            value = getattr(self, name)
            setattr(self, name, (value,) if isinstance(value, (str, int)) else tuple(value))
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes {list(self.modes)}: give one or both of {list(MODES)}")
        if not self.stream_counts or not _counts(self.stream_counts):
            raise ValueError(f"stream_counts {list(self.stream_counts)}: give positive integers")
        self.stream_counts = tuple(sorted(set(self.stream_counts)))
        if self.dtype == "auto":
            self.dtype = "float32" if self.device == "cpu" else "bfloat16"
        for name in ("frames_per_chunk", "image_size", "answer_tokens", "adapters", "rank", "chunk_pool",
                     "hf_batch", "hf_batches", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.image_size % 28:
            raise ValueError(f"image_size must be a multiple of 28 (14-pixel patches merged 2 x 2), "
                             f"got {self.image_size}")
        if self.cold_streams < 0 or not self.cold_seconds > 0:
            raise ValueError("cold_streams must be >= 0 (0: no cold point) and cold_seconds positive")
        if self.profile_first_steps < 0:
            raise ValueError(f"profile_first_steps must be >= 0, got {self.profile_first_steps}")
        if not _counts(self.ramp_counts):
            raise ValueError(f"ramp_counts {list(self.ramp_counts)}: give positive integers")
        if not _counts(self.window_counts) or not self.window_seconds > 0:
            raise ValueError(f"window_counts {list(self.window_counts)}: give positive integers, and window_seconds "
                             f"a positive length, got {self.window_seconds!r}")
        if not self.seconds > 0 or self.warmup_s < 0 or self.drain_s < 0 or not self.target_ms > 0:
            raise ValueError("seconds and target_ms must be positive, warmup_s and drain_s >= 0")
        if not 0 <= self.sustain_s < math.inf:
            raise ValueError(f"sustain_s must be finite and >= 0, got {self.sustain_s}")
        if self.encoding not in ("raw", "png", "jpeg"):
            raise ValueError(f"encoding must be raw, png or jpeg, got {self.encoding!r}")


def render_chunks(job: StreamsBenchJob) -> list[np.ndarray]:
    """`chunk_pool` chunks, RGB uint8 [T, S, S, 3]: one second each of the synthetic camera at
    `frames_per_chunk` fps (the world's clips back to back), rendered before any timing."""
    import cv2

    from world import WorldConfig

    from apps.video_analytics.sources import SyntheticCamera

    side = max(64, job.image_size)  # the world draws at least 64 x 64
    world = WorldConfig(seed=job.seed, width=side, height=side, fps=job.frames_per_chunk,
                        clip_frames=max(2, job.frames_per_chunk))
    camera = SyntheticCamera(world)
    camera.open()
    chunks = []
    for _ in range(job.chunk_pool):
        if job.static_camera:
            frames = [camera.read().image] * job.frames_per_chunk
        else:
            frames = [camera.read().image for _ in range(job.frames_per_chunk)]
        if side != job.image_size:
            frames = [cv2.resize(f, (job.image_size, job.image_size), interpolation=cv2.INTER_AREA) for f in frames]
        chunks.append(np.ascontiguousarray(np.stack(frames)[..., ::-1]))  # BGR -> RGB
    return chunks


def adapter_names(job: StreamsBenchJob) -> list[str]:
    return [f"a{i}" for i in range(job.adapters)]


def _engine(job: StreamsBenchJob, workdir: Path, hf, prompt_tokens: int):
    """The engine on the model's weights with `adapters` random adapters (+ heads) loaded at start."""
    from bench.adapters import write_head
    from bench.adapter_parts import write_peft_adapter
    from serve.engine import Engine, EngineConfig
    from serve.models import read_model_args

    args = read_model_args(workdir)[0]
    wdtype = getattr(torch, job.dtype)
    dirs = {name: write_peft_adapter(workdir / "adapters" / name, args, job.rank, job.targets, 1000 + i,
                                     wdtype, job.device) for i, name in enumerate(adapter_names(job))}
    for path in dirs.values():
        write_head(path, args.hidden_size)
    per_seq = prompt_tokens + job.answer_tokens + 32
    cuda = job.device.startswith("cuda")
    config = EngineConfig(device=job.device, dtype=job.dtype, max_batch_size=job.max_batch_size,
                          max_tokens_per_step=job.max_tokens_per_step, seed=job.seed, encode_ahead=job.encode_ahead,
                          warm_up="on" if job.engine_warm_up else "off", warm_up_side=job.image_size,
                          warm_up_frames=job.frames_per_chunk, max_prefill_with_decode=job.max_prefill_with_decode,
                          num_kv_blocks=2 * job.max_batch_size * per_seq // 16 + 64 if cuda else None,
                          graph_batch_sizes=tuple(sorted({1, 2, 4, 8, 16, 24, 32, 48, 64, job.max_batch_size})),
                          adapter_slots=job.adapters, host_adapter_cache=job.adapters + 4, max_lora_rank=job.rank,
                          lora_targets=job.targets, adapters=tuple(f"{n}={p}" for n, p in dirs.items()),
                          policy=job.policy, policy_params=job.policy_params, quantization=job.quantization)
    return Engine(workdir, config, weights=dict(hf.state_dict())), list(dirs)


def search(run_point, counts: tuple[int, ...], refine: int) -> list[dict]:
    """Rows of the points run: `counts` upwards until one fails, then `refine` bisection steps
    between the last pass (0 if none) and the first failure. run_point(n) -> row with "pass"."""
    rows, low, high = [], 0, None
    for n in counts:
        rows.append(run_point(n))
        if not rows[-1]["pass"]:
            high = n
            break
        low = n
    for _ in range(refine):
        if high is None or high - low <= 1:
            break
        mid = (low + high) // 2
        rows.append(run_point(mid))
        low, high = (mid, high) if rows[-1]["pass"] else (low, mid)
    return sorted(rows, key=lambda r: r["streams"])


def run_streams_bench(job: StreamsBenchJob) -> tuple[list[dict], dict]:
    """Runs the search of every mode and the baseline; writes CSV / JSON / PNG; returns (rows, meta)."""
    from bench.engine import build_random_model
    from zoo import get_spec

    from .streams_hf import chunk_flops, hf_chunks_per_s, matmul_tflops
    from .streams_load import run_point
    from .streams_report import cold_summary, floor_summary, summarize, write_report
    from .streams_served import Served, max_connections, set_encode_ahead

    cuda = job.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("device=cuda asked for but no CUDA device is available; use device=cpu with a tiny model "
                           "(model=qwen2_vl_tiny image_size=56)")
    if get_spec(job.model).arch not in ("qwen2_vl", "qwen2_5_vl"):
        raise ValueError(f"model {job.model!r}: the streams evaluation sends video chunks, which only the "
                         "Qwen2-VL / Qwen2.5-VL zoo models take")
    from serve.models.fp8 import check_quantization

    check_quantization(job.quantization, torch.device(job.device))  # before the model is built: one clear line
    device_name = device_label(job.device)
    if job.fresh_caches:  # before anything compiles; both are read when a kernel is first compiled
        caches = Path(tempfile.mkdtemp(prefix="streams-caches-"))
        os.environ["TRITON_CACHE_DIR"] = str(caches / "triton")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(caches / "inductor")
    command = job.command or " ".join([Path(sys.argv[0]).name] + [shlex.quote(a) for a in sys.argv[1:]])
    _log(f"building {job.model} ({job.dtype}) on {job.device} and rendering {job.chunk_pool} chunks")
    workdir = Path(tempfile.mkdtemp(prefix="streams-bench-"))
    t0 = time.perf_counter()
    hf, processor = build_random_model(job.model, job.seed, job.dtype, job.device, workdir)
    chunks = render_chunks(job)
    flops = chunk_flops(hf, processor, job, chunks[0])
    warm, on_server = None, False
    if job.engine_process:  # as `vlora serve` runs it: built in a process of its own, warmed up on its loop's thread
        served, _ = Served.spawn(job, workdir, flops["prompt_tokens"], max_connections(job))
        names, warm = adapter_names(job), served.process.warm
        if warm is not None:
            warm = dict(warm, wall_s=warm["seconds"], thread="engine process")
            _log(f"engine warm-up in the engine process: {warm}")
        start_s = time.perf_counter() - t0
        load_s = start_s - (warm["seconds"] if warm else 0.0)
    else:
        engine, names = _engine(job, workdir, hf, flops["prompt_tokens"])
        served = Served(engine)
        load_s = time.perf_counter() - t0
        # with a cold point, the server's own thread warms up first and then serves, as under `vlora serve` (warmed
        # up on this thread instead, the cold points' first steps took 0.9-1.3 s on an H100 where 0.3-0.5 s were usual)
        on_server = job.engine_warm_up and job.cold_streams > 0
        if job.engine_warm_up and not on_server:
            t1 = time.perf_counter()
            warm = dict(engine.warm_up().to_dict(), wall_s=time.perf_counter() - t1)
            _log(f"engine warm-up: {warm}")
        start_s = time.perf_counter() - t0
    _log(f"ready in {start_s:.1f} s (model and engine {load_s:.1f} s): {flops['prompt_tokens']} prompt tokens and "
         f"{flops['patches']} patches per chunk, {flops['head'] / 1e12:.2f} TFLOP per chunk (head)")
    rows = []
    if job.cold_streams:  # first, before the matmul timing or any warm-up point touches the GPU
        rows.append(run_point(served, job, job.modes[0], job.cold_streams, chunks, names, cold=True,
                              profile=job.profile_first_steps))
        if on_server:
            warm = dict(served.engine.warm_report.to_dict(), wall_s=rows[0]["server_warm_up_s"], thread="server")
            start_s += warm["wall_s"]
            _log(f"ready after the warm-up: {start_s:.1f} s from the start")
    tflops = matmul_tflops(job)
    _log(f"matmul {tflops:.1f} TFLOP/s")
    for mode in job.modes:
        if job.warmup_point_s > 0:
            run_point(served, job, mode, min(job.stream_counts), chunks, names, seconds=job.warmup_point_s)
        rows += search(lambda n: run_point(served, job, mode, n, chunks, names), job.stream_counts, job.refine)
    if job.cold_streams and not any(r["point"] == "warm" and r["mode"] == job.modes[0] and r["streams"] == job.cold_streams
                                    for r in rows):  # the warm point the cold one is compared with
        rows.append(run_point(served, job, job.modes[0], job.cold_streams, chunks, names))
    for n in job.ahead_off_counts:
        before = served.run(functools.partial(set_encode_ahead, on=False))
        try:
            rows.append(dict(run_point(served, job, job.modes[0], n, chunks, names), point="warm-ahead-off"))
        finally:
            served.run(functools.partial(set_encode_ahead, on=before))
    for i, n in enumerate(job.ramp_counts):
        rows.append(dict(run_point(served, job, job.modes[0], n, chunks, names, cold=True,
                                   profile=0 if i else job.profile_first_steps), point="ramp"))
    long = dataclasses.replace(job, seconds=job.window_seconds)
    for n in job.window_counts:
        rows.append(dict(run_point(served, long, job.modes[0], n, chunks, names), point="window"))
    visual_tokens = flops["patches"] // 4  # 2 x 2 patches merge into one token (Qwen2-VL / Qwen2.5-VL)
    for row in rows:
        row["vision_tokens_per_s"] = row["chunks_per_s"] * visual_tokens
    in_process = None
    if job.engine_only:
        from .streams_engine import engine_only, format_engine_only

        in_process = served.run(functools.partial(engine_only, job=job, chunks=chunks, names=names,
                                                  rates=job.engine_only_rates, seconds=job.seconds), 3600.0)
        _log(format_engine_only(in_process))
    hf_result = None
    if job.hf_baseline:
        _log(f"transformers generate, {job.hf_batch} chunks per batch, {job.hf_batches} batches")
        hf_result = hf_chunks_per_s(hf, processor, job, chunks)
        _log(f"transformers: {hf_result['chunks_per_s']:.2f} chunks/s")
    sustained = None
    if cuda and job.matmul_sustained_s > 0:  # last: the load heats the GPU, which no point should start from
        from vlora_kernels.timing import sustained_matmul_tflops

        with torch.cuda.device(torch.device(job.device)):
            sustained = sustained_matmul_tflops(job.matmul_n, getattr(torch, job.dtype), job.matmul_sustained_s)
        _log(f"matmul sustained for {job.matmul_sustained_s:g} s: {sustained}")
    summary = summarize(rows, job, flops, tflops, hf_result, sustained and sustained["tflops"])
    meta = dict(device=device_name, date=time.strftime("%Y-%m-%d"), command=command, engine_load_s=load_s,
                start_s=start_s, warm_up=warm, cold=cold_summary(rows, job), visual_tokens_per_chunk=visual_tokens,
                matmul_tflops=tflops, matmul_sustained=sustained, floor=floor_summary(flops, tflops, sustained, in_process),
                flops=flops, hf=hf_result, summary=summary, adapters=names, engine_only=in_process,
                torch=torch.__version__, transformers=__import__("transformers").__version__,
                quantization=job.quantization, job=dataclasses.asdict(job))
    served.close()
    del served
    gc.collect()
    write_report(rows, meta, results_dir(job.out_dir, device_name))
    return rows, meta
