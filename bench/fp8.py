"""FP8 benchmark (`vlora bench bench.suite=fp8`): FP8 projections against bf16, both against fp32, one run.

A zoo model of the published shape (random weights, drawn in bf16) is loaded three times from the
same tensors: fp32 (the reference), bf16, and bf16 with quantization=fp8 (serve/models/fp8.py).
Each engine decodes the same prompts greedily, with no adapter and with one random adapter (rank
`rank` on `modules`); bf16 and fp8 also with that adapter merged into the weights. Reported:

- accuracy: logits and greedy tokens of bf16 and fp8 against fp32 (bench/fp8_accuracy.py: error
  up to the first divergence, token agreement, first divergence and the reference's margin there),
  and merged against unmerged on the same precision (the error a merge adds);
- decode step per batch size: on a GPU the CUDA-graph replay the engine runs plus the LM head
  (device time), and everywhere the engine's wall time per decode-only step;
- weight memory: the projections' bytes, and for fp8 the bytes the merged mode keeps to restore;
- switch: merge and unmerge of the adapter (median ms), fp8 over bf16 (target <= 1.5), and whether
  unmerge gave back the exact weights;
- heads (heads=true, or heads_only=true alone): trained adapters' head answers and caption tokens,
  FP8 against bf16 on the same world items, each beside the truth (bench/fp8_heads.py).

On the CPU (tiny model, `device=cpu`) FP8 is let through by serve.models.fp8.ALLOW_CPU for the
length of the run: it measures the same arithmetic, not serving speed.

    rows, meta = run_fp8_bench(Fp8BenchJob(model="qwen2_vl_tiny", device="cpu", prompts=2, output_tokens=4))
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vlora_kernels import fp8 as fp8_kernels
from vlora_kernels import fp8_decode
from vlora_kernels import interpreter
from serve.engine import Engine, EngineConfig, Request, SamplingParams
from serve.forward import decode_kernel
from serve.models import fp8 as fp8_models
from serve.models import read_model_args
from serve.orchestrator import Mode

from .adapter_parts import ALL_MODULES, write_peft_adapter
from .engine import _hf_inputs, _prompts, _run_engine, build_random_model, replay_step
from .fp8_accuracy import compare_outputs, projection_bytes
from .fp8_gemm import gemm_rows
from .fp8_heads import check_heads_job, heads_rows
from .fp8_profile import profile_decode
from .fp8_report import write_report
from .results import device_label, results_dir

# name -> (engine dtype, quantization); fp8_unfused (compare_unfused=true): every FP8 projection quantizes its
# input itself, not the norm or SiLU-mul before it (serve.models.fp8.fuse_quantization): same numbers, more launches;
# fp8_w8a16 (compare_w8a16=true): at decode sizes the FP8 GEMM takes the bf16 activations as they are, not their
# per-token FP8 rows (vlora_kernels/fp8.py DECODE_ACTIVATIONS "bf16"; "fp8" runs this process's setting, "fp8" by default)
# fp8_no_gemm_pdl (compare_gemm_pdl=true): decode GEMMs launched after their producer has finished, not with PDL behind
# it with their weight prefetched (vlora_kernels/fp8_decode.py GEMM_PDL off): the same bits; fp8_head
# (compare_fp8_lm_head=true): the LM head in FP8 as well (EngineConfig.fp8_lm_head); fp8_no_attn_rows
# (compare_attention_rows=true): o_proj quantizes its input per token itself at decode, not the decode attention per
# kv head group (serve.models.fp8.FUSE_ATTENTION_ROWS off): one more launch a layer, one scale per token
PRECISIONS = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"), "fp8": ("bfloat16", "fp8"),
              **{name: ("bfloat16", "fp8") for name in ("fp8_unfused", "fp8_w8a16", "fp8_no_gemm_pdl", "fp8_head",
                                                        "fp8_no_attn_rows")}}
OPTIONAL = {"fp8_unfused": "compare_unfused", "fp8_w8a16": "compare_w8a16", "fp8_no_gemm_pdl": "compare_gemm_pdl",
            "fp8_head": "compare_fp8_lm_head", "fp8_no_attn_rows": "compare_attention_rows"}


@dataclass
class Fp8BenchJob:
    model: str = "qwen2_vl_7b"  # a zoo spec: random weights of the published shape
    device: str = "cuda"  # cpu: a tiny zoo model (model=qwen2_vl_tiny image_size=56)
    prompts: int = 16  # accuracy prompts (text + one image each)
    prompt_tokens: int = 128
    image_size: int = 336
    output_tokens: int = 32  # greedy tokens per prompt, no early stop
    batch_sizes: tuple[int, ...] = (1, 32, 64)
    decode_context: int = 512  # tokens of context per sequence in the timed GPU decode step
    decode_tokens: int = 16  # tokens per request in the wall-time decode runs
    rank: int = 16
    modules: tuple[str, ...] = ALL_MODULES
    switch_repeats: int = 10
    # per precision and batch, a few decode steps under torch.profiler after the timed runs: a per-kernel
    # table (profile_<precision>_b<batch>.csv) and the time in GEMMs / quantization / attention / other
    profile: bool = False
    profile_repeats: int = 3
    compare_unfused: bool = False  # also fp8_unfused: the fused quantization's A/B (a fourth engine)
    compare_w8a16: bool = False  # also fp8_w8a16: decode GEMMs on the bf16 activations as they are (weight-only's A/B)
    compare_gemm_pdl: bool = False  # also fp8_no_gemm_pdl: decode GEMMs without PDL and weight prefetch (their A/B)
    compare_fp8_lm_head: bool = False  # also fp8_head: the LM head in FP8 too (its speed and its logits' error)
    compare_attention_rows: bool = False  # also fp8_no_attn_rows: o_proj's input quantized per token on its own
    gemm: bool = True  # each projection's GEMM alone, bf16 against FP8 (bench/fp8_gemm.py), after the engines
    # trained adapters' task-head answers and caption tokens, FP8 against bf16 on the same world items
    # (bench/fp8_heads.py, section "heads"); heads_only: that section alone, no random-weight engines
    heads: bool = False
    heads_only: bool = False
    adapters_dir: str | None = None  # a fusion manifest's folder or an adapter; None: adapters trained here
    heads_model: str = "qwen2_vl_tiny"  # zoo model the adapters are trained on (adapters_dir: their own base)
    heads_domains: tuple[str, ...] = ("exists_bus", "count_vehicles", "class_main", "detect_car")
    heads_items: int = 256  # held-out items per domain, answered by both precisions
    heads_train_items: int = 512
    heads_epochs: int = 4
    heads_image_size: int = 224  # the world's frames (square)
    heads_captions: int = 8  # caption prompts for the greedy-token comparison (0: none)
    heads_caption_tokens: int = 24
    seed: int = 0
    out_dir: str = "results/bench/fp8"
    command: str = ""


@contextlib.contextmanager
def _fp8_allowed(device: torch.device, fuse: bool = True, attention_rows: bool = True):
    old = fp8_models.ALLOW_CPU, fp8_models.FUSE_QUANTIZATION, fp8_models.FUSE_ATTENTION_ROWS
    fp8_models.ALLOW_CPU = old[0] or device.type == "cpu"
    fp8_models.FUSE_QUANTIZATION = fuse
    fp8_models.FUSE_ATTENTION_ROWS = old[2] and attention_rows
    try:
        yield
    finally:
        fp8_models.ALLOW_CPU, fp8_models.FUSE_QUANTIZATION, fp8_models.FUSE_ATTENTION_ROWS = old


@contextlib.contextmanager
def _decode_kernels(name: str):
    """vlora_kernels.fp8.DECODE_ACTIVATIONS and vlora_kernels.fp8_decode.GEMM_PDL as engine `name` wants them, for its whole
    life: the kernels read them at every forward, CUDA-graph captures included."""
    old = fp8_kernels.DECODE_ACTIVATIONS, fp8_decode.GEMM_PDL
    if name == "fp8_w8a16":
        fp8_kernels.DECODE_ACTIVATIONS = "bf16"
    if name == "fp8_no_gemm_pdl":
        fp8_decode.GEMM_PDL = False
    try:
        yield
    finally:
        fp8_kernels.DECODE_ACTIVATIONS, fp8_decode.GEMM_PDL = old


def _engine(job: Fp8BenchJob, workdir: Path, weights: dict, name: str, kv_blocks: int) -> Engine:
    dtype, quantization = PRECISIONS[name]
    cuda = job.device.startswith("cuda")
    config = EngineConfig(device=job.device, dtype=dtype, quantization=quantization,
                          max_batch_size=max(job.batch_sizes + (job.prompts,)), max_tokens_per_step=8192,
                          fp8_lm_head=name == "fp8_head", num_kv_blocks=kv_blocks, cuda_graphs=cuda and name != "fp32",
                          graph_batch_sizes=tuple(sorted(set(job.batch_sizes) | {1, 2, 4, 8, 16, 32, 64})),
                          lora_graph_segments=(), lora_graph_seg_lens=(), encoder_cache_items=0,
                          enable_prefix_cache=False, seed=job.seed, warm_up="off", encode_ahead="off",
                          vision_compile=False,  # three engines: the tower's compile is no part of what is measured
                          adapter_slots=1, host_adapter_cache=2, max_lora_rank=job.rank, lora_targets=job.modules)
    with _fp8_allowed(torch.device(job.device), fuse=name != "fp8_unfused", attention_rows=name != "fp8_no_attn_rows"):
        return Engine(workdir, config, weights=weights)


def _generate(engine: Engine, prompts, adapter: str | None, tokens: int) -> list:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, keep_logits=True, detokenize=False)
    outs = engine.generate([Request(prompt=text, images=[image], sampling=params, adapter=adapter)
                            for text, image in prompts])
    for o in outs:  # kept on the host: three engines' worth of vocabulary-wide logits
        o.logits = [x.float().cpu() for x in o.logits]
    return outs


def _decode_rows(engine: Engine, job: Fp8BenchJob, name: str) -> list[dict]:
    rows = []
    for b in job.batch_sizes:
        step_ms = float("nan")
        if engine.runner.graphs is not None:
            from vlora_kernels.timing import time_op

            step_ms = time_op(replay_step(engine, b, [job.decode_context] * b), warmup=3, repeats=20,
                              use_graph=False) / 1e3
        run = _run_engine(engine, dataclasses.replace(job, output_tokens=job.decode_tokens),
                          _prompts(job, engine.tokenizer, b, 1000 * b))
        rows.append(dict(section="decode", precision=name, batch=b, decode_step_ms=step_ms,
                         decode_context=job.decode_context, decode_wall_ms=run["decode_wall_ms"]))
    return rows


def _switch_row(engine: Engine, job: Fp8BenchJob, name: str) -> dict:
    merger, record = engine.lora.merger, engine.lora.get("a")
    if record.slot is None:
        raise RuntimeError("the adapter left its slot before the switch timing")
    before = {k: w.clone() for k, w in merger.weights.items()}
    scales = {k: s.clone() for k, s in merger.fp8.scales.items()} if merger.fp8 else {}
    merger.fold(record.slot, +1)  # compiles and first touches out of the timing
    merger.fold(record.slot, -1)
    merge_ms, unmerge_ms = [], []
    for _ in range(job.switch_repeats):
        merge_ms.append(merger.fold(record.slot, +1))
        unmerge_ms.append(merger.fold(record.slot, -1))
    # layer by layer: whole-kind temporaries would take tens of GB at the 7B
    exact = all(torch.equal(before[k][i].view(torch.uint8), w[i].view(torch.uint8))
                for k, w in merger.weights.items() for i in range(w.shape[0]))
    if merger.fp8 is not None:
        exact = exact and all(torch.equal(scales[k], s) for k, s in merger.fp8.scales.items())
    drift = max((w[i].float() - before[k][i].float()).abs().max().item()
                for k, w in merger.weights.items() for i in range(w.shape[0]))
    saved = merger.fp8.nbytes()["saved"] if merger.fp8 else 0
    method = f"requantize:{merger.method}" if merger.fp8 else merger.method
    return dict(section="switch", precision=name, rank=job.rank, method=method,
                merge_ms=statistics.median(merge_ms), unmerge_ms=statistics.median(unmerge_ms),
                switch_ms=statistics.median(m + u for m, u in zip(merge_ms, unmerge_ms)),
                restore_exact=exact, max_drift_after_switches=drift, projection_bytes=projection_bytes(engine),
                merge_saved_bytes=saved)


def run_fp8_bench(job: Fp8BenchJob) -> tuple[list[dict], dict]:
    """Writes fp8.csv, fp8.json and fp8.md under out_dir/<device>/ and returns (rows, meta)."""
    device = torch.device(job.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"bench.fp8.device={job.device!r} but no CUDA device is available; use device=cpu "
                           "with model=qwen2_vl_tiny")
    if device.type == "cuda":
        fp8_models.check_quantization("fp8", device)  # before the model is built
    if job.profile_repeats < 1:
        raise ValueError(f"bench.fp8.profile_repeats={job.profile_repeats}: must be >= 1")
    if job.heads or job.heads_only:
        check_heads_job(job)  # before any model is built
    label = device_label(device)
    out = results_dir(job.out_dir, label)
    workdir = Path(tempfile.mkdtemp(prefix="fp8-bench-"))
    if job.heads_only:
        rows = heads_rows(job, workdir)
        meta = dict(device=label, date=time.strftime("%Y-%m-%d"), torch=torch.__version__, job=dataclasses.asdict(job))
        write_report(rows, meta, out)
        return rows, meta
    hf, processor = build_random_model(job.model, job.seed, "bfloat16", job.device, workdir)
    weights = {k: v.detach().cpu() for k, v in hf.state_dict().items()}  # each engine copies from the host
    del hf
    gc.collect()
    prompts = _prompts(job, processor.tokenizer, job.prompts, 0)
    prompt_len = _hf_inputs(processor, prompts[:1])["input_ids"].shape[1]
    per_seq = max(prompt_len + job.output_tokens, job.decode_context, prompt_len + job.decode_tokens) + 32
    kv_blocks = max(job.batch_sizes + (job.prompts,)) * per_seq // 16 + 64
    args = read_model_args(workdir)[0]
    adapter = write_peft_adapter(workdir / "adapter", args, job.rank, tuple(job.modules), job.seed + 1,
                                 torch.bfloat16, job.device)
    outs, rows, load_s = {}, [], {}
    for name in (p for p in PRECISIONS if p not in OPTIONAL or getattr(job, OPTIONAL[p])):
        with _decode_kernels(name):
            t0 = time.perf_counter()
            engine = _engine(job, workdir, weights, name, kv_blocks)
            load_s[name] = time.perf_counter() - t0
            engine.load_adapter("a", adapter)
            outs[name, "none", "unmerged"] = _generate(engine, prompts, None, job.output_tokens)
            outs[name, "a", "unmerged"] = _generate(engine, prompts, "a", job.output_tokens)
            if name != "fp32":
                engine.set_mode(Mode.merge("a"))
                outs[name, "a", "merged"] = _generate(engine, prompts, "a", job.output_tokens)
                engine.set_mode(Mode.unmerge())
                rows.append(_switch_row(engine, job, name))
                rows += _decode_rows(engine, job, name)
                if job.profile:  # after the timed runs, so the profiler's overhead is in none of them
                    rows += profile_decode(engine, job, name, out)
            print(f"fp8 bench: {name} done", file=sys.stderr, flush=True)
            del engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if job.gemm:  # with every engine gone: the GPU's memory holds only the weight copies it times
        rows += gemm_rows(args, job.batch_sizes, job.device, job.seed)
    if job.heads:
        rows += heads_rows(job, workdir)
    for (name, adapter, mode), got in outs.items():
        if name == "fp32":
            continue
        rows.append(dict(section="accuracy", precision=name, adapter=adapter, mode=mode, against="fp32",
                         **compare_outputs(outs["fp32", adapter, "unmerged"], got)))
        if mode == "merged":
            rows.append(dict(section="accuracy", precision=name, adapter=adapter, mode=mode,
                             against=f"{name} unmerged", **compare_outputs(outs[name, adapter, "unmerged"], got)))
        if name in OPTIONAL:  # the fusion and PDL move launches, not numbers: zero error expected; the weight-only
            # GEMM multiplies at decode what the FP8 form rounds to 3 mantissa bits first; fp8_head: the head's error;
            # fp8_no_attn_rows: one scale per token where fp8 has one per kv head group
            rows.append(dict(section="accuracy", precision=name, adapter=adapter, mode=mode, against="fp8",
                             **compare_outputs(outs["fp8", adapter, mode], got)))
    meta = dict(device=label, date=time.strftime("%Y-%m-%d"), torch=torch.__version__, engine_load_s=load_s,
                prompt_len=prompt_len, layers=args.num_layers, decode_activations=fp8_kernels.DECODE_ACTIVATIONS,
                gemm_pdl=fp8_decode.GEMM_PDL, pdl_chain=interpreter.PDL_CHAIN,
                decode_splits=decode_kernel.DECODE_SPLITS or "auto",
                job=dataclasses.asdict(job), switch_target="fp8 switch_ms <= 1.5 x bf16")
    write_report(rows, meta, out)
    return rows, meta
