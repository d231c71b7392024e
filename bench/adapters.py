"""Adapter benchmark (GPU): the engine serving LoRA adapters against its memory floor, against itself
without adapters, and against Hugging Face transformers + PEFT (`adapter_names=`) on the same
model and batch; head versus LM-head latency; adapter swap-in against the pinned H2D floor.

A 7B-shaped zoo model with random weights is built once; adapters are random PEFT directories of
its shape, for two shapes (rank 16 on q/k/v/o; rank 64 on all seven projections). Per shape and
mix (no adapter, one, 8 and 32 distinct, Zipf-1.5 over 8 and 32) a batch of `batch_size`
requests (~prompt_tokens text tokens + one image each, no cache reuse) decodes `output_tokens`
tokens; reported per row:

- decode step: device time of the CUDA-graph replay + LM head at mid-decode context lengths, its
  floor (LM weights + the K/V the step reads + the distinct adapters' bytes, over the measured
  copy bandwidth), step / floor, and step / the same shape's no-adapter step;
- end-to-end: decode wall time per step (scheduling and Python included), decode tokens/s, and
  tokens/s over the whole run;

then transformers + PEFT `generate` on the `hf_mix` batch of the r64 shape (tokens/s, our
speedup); head vs LM-head latency of a classification head (batch 1 and batch_size); swap-in
of a rank-64 q/k/v/o and a rank-64 all-seven adapter, alone and overlapped with decode steps.

    rows, meta = run_adapter_bench(AdapterBenchJob())      # writes adapters.csv / adapters.json
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.engine import _floor_ms, _hf_inputs, _prompts, _replay_ms, _run_engine, build_random_model, replay_step
from bench.adapter_parts import (SHAPES, assign, head_latency_ms, pinned_h2d_gbs, swap_ms, timed,
                                    write_peft_adapter)
from serve.engine import Engine, EngineConfig
from serve.models import read_model_args
from .results import device_label, results_dir, write_csv, write_json


@dataclass
class AdapterBenchJob:
    model: str = "qwen2_vl_7b"
    batch_size: int = 32
    prompt_tokens: int = 256
    image_size: int = 336
    output_tokens: int = 64
    dtype: str = "bfloat16"
    shapes: tuple[str, ...] = ("r16_qkvo", "r64_all")
    mixes: tuple[str, ...] = ("none", "one", "distinct8", "zipf8", "distinct32", "zipf32")
    zipf_alpha: float = 1.5
    hf_baseline: bool = True
    hf_shape: str = "r64_all"  # transformers + PEFT run the batch of this shape and mix
    hf_mix: str = "zipf8"
    head_answer_tokens: int = 4  # LM-head decoding of a label: the label's tokens and the end token
    swap_repeats: int = 10
    max_tokens_per_step: int = 8192
    overlap_shrink: bool = False  # the engine's lora_overlap_shrink
    graph_segments: tuple[int, ...] = (1, 8)  # the engine's lora_graph_segments
    graph_seg_lens: tuple[int, ...] = (1, 8)  # the engine's lora_graph_seg_lens
    # GPU: each row's decode step broken down by kernel kind (profile.csv). The rows timed after the
    # first profile ran slower (the profiler stays attached): time in a run without it
    profile: bool = False
    device: str = "cuda"  # "cpu" runs a smoke version on a tiny model (no device timings)
    seed: int = 0
    out_dir: str = "results/engine_adapters"


def write_head(adapter: Path, hidden: int) -> None:
    """A seeded classify head (the task streams_load.HEAD_TASK names) beside an adapter."""
    from heads import HeadConfig, build_head, save_head

    torch.manual_seed(0)
    head = build_head(HeadConfig(type="classify", hidden_size=hidden, labels=["car", "truck", "bus", "bike"]))
    save_head(head, adapter / "heads" / "vehicle")


def _adapter_count(mixes) -> int:
    return max([1] + [int("".join(c for c in m if c.isdigit())) for m in mixes if any(c.isdigit() for c in m)])


def _engine(job, workdir, hf, shape: str, slots: int, per_seq: int) -> Engine:
    rank, modules = SHAPES[shape]
    config = EngineConfig(device=job.device, dtype=job.dtype, max_batch_size=job.batch_size,
                          max_tokens_per_step=job.max_tokens_per_step,
                          num_kv_blocks=job.batch_size * per_seq // 16 + 64,
                          graph_batch_sizes=tuple(sorted({1, 2, 4, 8, 16, 32, job.batch_size})),
                          encoder_cache_items=0, enable_prefix_cache=False, seed=job.seed, adapter_slots=slots,
                          host_adapter_cache=slots + 4, max_lora_rank=rank, lora_targets=modules,
                          lora_overlap_shrink=job.overlap_shrink,
                          lora_graph_segments=tuple(job.graph_segments), lora_graph_seg_lens=tuple(job.graph_seg_lens))
    return Engine(workdir, config, weights=dict(hf.state_dict()))


def _hf_peft(hf, processor, job, prompts, adapters, dirs) -> float:
    """tokens/s of transformers + PEFT `generate` on the batch, each request with its adapter."""
    from peft import PeftModel

    names = sorted({a for a in adapters if a})
    model = PeftModel.from_pretrained(hf, str(dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(dirs[name]), adapter_name=name)
    inputs = _hf_inputs(processor, prompts).to(job.device)
    n = job.output_tokens

    def run():
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           adapter_names=[a or "__base__" for a in adapters])
        if job.device == "cuda":
            torch.cuda.synchronize()

    _, seconds = timed(run)
    model.unload()  # the base model back, without LoRA layers
    return len(prompts) * n / seconds


def _swap_rows(engine, gpu, names, repeats, batch) -> list[dict]:
    h2d = pinned_h2d_gbs()
    graphs = engine.runner.graphs
    bs = next(s for s in graphs.batch_sizes if s >= batch)

    def steps(k=5):
        for _ in range(k):
            graphs.graphs[bs].replay()
        return k

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    alone = []
    for _ in range(repeats):
        start.record()
        steps()
        end.record()
        end.synchronize()
        alone.append(start.elapsed_time(end) / 5)
    rows = []
    for label, name in names.items():
        nbytes = engine.lora.records[name].spec.nbytes
        swap, _ = swap_ms(engine, name, repeats)
        swap_overlapped, step_during = swap_ms(engine, name, repeats, overlap=steps)
        floor = nbytes / (h2d * 1e9) * 1e3
        rows.append(dict(gpu=gpu, adapter=label, mb=nbytes / 2**20, h2d_gbs=h2d, floor_ms=floor, swap_ms=swap,
                         swap_over_floor=swap / floor, swap_overlapped_ms=swap_overlapped,
                         decode_step_ms_alone=statistics.median(alone), decode_step_ms_during_swap=step_during))
        _print(rows[-1])
    return rows


def run_adapter_bench(job: AdapterBenchJob) -> tuple[list[dict], dict]:
    cuda = job.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("the adapter benchmark needs a CUDA device (device=cpu runs a smoke version)")
    from vlora_kernels.timing import copy_bandwidth_gbs

    gpu = device_label(job.device)
    gbs = copy_bandwidth_gbs() if cuda else math.nan
    workdir = Path(tempfile.mkdtemp(prefix="adapter-bench-"))
    hf, processor = build_random_model(job.model, job.seed, job.dtype, job.device, workdir)
    args = read_model_args(workdir)[0]
    count = _adapter_count(job.mixes)
    slots = count + 1  # the mixes' adapters and the swap adapter; it sizes the any-mix graphs' grid
    b = job.batch_size
    prompt_len = _hf_inputs(processor, _prompts(job, processor.tokenizer, 1, 0))["input_ids"].shape[1]
    per_seq = prompt_len + job.output_tokens + 32
    rows, extra = [], {"hf": [], "head": [], "swap": [], "profile": []}
    wdtype = getattr(torch, job.dtype)
    for s, shape in enumerate(job.shapes):
        rank, modules = SHAPES[shape]
        dirs = {f"{shape}_{i}": write_peft_adapter(workdir / "adapters" / f"{shape}_{i}", args, rank, modules,
                                                   1000 * s + i, wdtype, job.device) for i in range(count)}
        write_head(dirs[f"{shape}_0"], args.hidden_size)
        if shape == "r64_all":  # the swap target: rank 64 on q/k/v/o of the 7B shape
            dirs["swap_qkvo"] = write_peft_adapter(workdir / "adapters" / "swap_qkvo", args, 64, SHAPES["r16_qkvo"][1],
                                                   99, wdtype, job.device)
        engine, load_s = timed(lambda: _engine(job, workdir, hf, shape, slots, per_seq))
        for name, path in dirs.items():
            engine.load_adapter(name, path)
        names = [n for n in dirs if n.startswith(shape)]
        warm = dataclasses.replace(job, output_tokens=4)
        _run_engine(engine, warm, _prompts(job, engine.tokenizer, 2, 10**6), [names[0], None])
        base_step = None
        for m, mix in enumerate(job.mixes):
            prompts = _prompts(job, engine.tokenizer, b, 10**4 * (s * 100 + m + 1))
            adapters = assign(mix, b, names, job.zipf_alpha, job.seed + m)
            run = _run_engine(engine, job, prompts, adapters)
            mid = [n + job.output_tokens // 2 for n in run["prompt_lens"]]
            slot_ids = [engine.lora.slot_of(a) for a in adapters]
            step = _replay_ms(engine, b, mid, slot_ids) if cuda else math.nan
            distinct = sorted({a for a in adapters if a})
            adapter_bytes = sum(engine.lora.records[a].spec.nbytes for a in distinct)
            floor = _floor_ms(engine, mid, gbs) + adapter_bytes / (gbs * 1e9) * 1e3
            base_step = step if mix == "none" else base_step
            # each LoRA'd projection of each layer is one LoRA op per step: what one op adds to the step
            lora_ops = len(engine.lora.layers)
            row = dict(gpu=gpu, model=job.model, shape=shape, mix=mix, batch=b, distinct_adapters=len(distinct),
                       adapter_mb=adapter_bytes / 2**20, decode_step_ms=step, decode_floor_ms=floor,
                       step_over_floor=step / floor, step_over_no_adapter=step / base_step if base_step else math.nan,
                       lora_ops=lora_ops, us_per_lora_op=(step - base_step) * 1e3 / lora_ops if base_step else math.nan,
                       decode_wall_ms=run["decode_wall_ms"], decode_tokens_per_s=b / (run["decode_wall_ms"] / 1e3),
                       e2e_tokens_per_s=run["tokens"] / run["total_s"], engine_load_s=load_s)
            rows.append(row)
            _print(row)
            if cuda and job.profile:
                extra["profile"] += _profile_rows(replay_step(engine, b, mid, slot_ids), row)
            if job.hf_baseline and shape == job.hf_shape and mix == job.hf_mix:
                hf_tps = _hf_peft(hf, processor, job, prompts, adapters, dirs)
                extra["hf"].append(dict(gpu=gpu, shape=shape, mix=mix, batch=b, hf_peft_tokens_per_s=hf_tps,
                                        ours_e2e_tokens_per_s=row["e2e_tokens_per_s"],
                                        ours_decode_tokens_per_s=row["decode_tokens_per_s"],
                                        speedup_e2e=row["e2e_tokens_per_s"] / hf_tps,
                                        speedup_decode=row["decode_tokens_per_s"] / hf_tps))
                _print(extra["hf"][-1])
        prompts = _prompts(job, engine.tokenizer, b, 7 * 10**6 + s)
        for batch in sorted({1, b}):
            head, lm = head_latency_ms(engine, prompts, names[0], "vehicle", job.head_answer_tokens, batch, 3)
            extra["head"].append(dict(gpu=gpu, shape=shape, batch=batch, head_ms=head, lm_head_ms=lm,
                                      answer_tokens=job.head_answer_tokens, head_faster_by=1 - head / lm))
            _print(extra["head"][-1])
        if cuda and shape == "r64_all":
            extra["swap"] += _swap_rows(engine, gpu, {"r64_qkvo": "swap_qkvo", "r64_all": names[0]},
                                        job.swap_repeats, b)
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    from vlora_kernels.interpreter import pdl_available

    meta = dict(gpu=gpu, date=time.strftime("%Y-%m-%d"), copy_gbs=gbs, torch=torch.__version__,
                pdl=pdl_available(torch.device(job.device)), adapter_slots=slots,
                transformers=__import__("transformers").__version__, peft=__import__("peft").__version__,
                triton=__import__("triton").__version__, job=dataclasses.asdict(job), **extra)
    _write(rows, meta, results_dir(job.out_dir, gpu))
    return rows, meta


def _profile_rows(step, row: dict, top: int = 12) -> list[dict]:
    """The step's device time by kernel kind, and its `top` longest kernels, as rows of profile.csv."""
    from bench.step_profile import by_kind, profile_step

    prof = profile_step(step)
    key = dict(shape=row["shape"], mix=row["mix"], span_us=prof["span_us"], idle_share=prof["idle_share"])
    kinds = [dict(key, group="kind", name=kind, launches=v["launches"], us=v["us"]) for kind, v in by_kind(prof).items()]
    for r in kinds:
        _print(r)
    return kinds + [dict(key, group="kernel", name=k["name"][:120], launches=k["launches"], us=k["us"])
                    for k in prof["kernels"][:top]]


def _print(row: dict) -> None:
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
          file=sys.stderr, flush=True)


def _write(rows: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "adapters.csv", rows)
    write_json(out / "adapters.json", {"meta": meta, "rows": rows})
    if meta.get("profile"):
        write_csv(out / "profile.csv", meta["profile"])
    cols = ("shape", "mix", "distinct_adapters", "decode_step_ms", "decode_floor_ms", "step_over_floor",
            "step_over_no_adapter", "decode_tokens_per_s", "e2e_tokens_per_s")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    for key in ("hf", "head", "swap"):
        for r in meta[key]:
            print(key, " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
