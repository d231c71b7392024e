"""Engine benchmark (GPU): our engine against Hugging Face transformers `generate`, same model, same batch.

A 7B-shaped zoo model with random weights (bf16) is built once in memory; the engine loads
the same tensors. For each batch size, requests of ~`prompt_tokens` text tokens plus one
image each (distinct images and texts, so no prefix or encoder-cache reuse) decode a fixed
number of tokens (no early stop). Reported per batch size:

- time to first token (all requests submitted at once, so it includes queueing for prefill),
- decode step: the device time of one graph replay plus the LM head (CUDA events), and its
  memory floor (LM weights + the K/V the step reads, over the measured copy bandwidth),
- end-to-end decode: wall time per decode step including scheduling and Python, and tokens/s,
- end-to-end tokens/s over the whole run (prefill included) for us and for `generate`.

    rows, meta = run_engine_bench(EngineBenchJob(model="qwen2_vl_7b", batch_sizes=(1, 8, 32)))

The adapter benchmark (bench/adapters.py) reuses these helpers with adapters per request.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from serve.engine import Engine, EngineConfig, Request, SamplingParams
from .results import device_label, results_dir, write_csv, write_json

WORDS = ("car truck bus bike red blue green white black left right crossing street lane parked moving "
         "near far two three many count color shape where which when camera frame road sign light").split()


@dataclass
class EngineBenchJob:
    model: str = "qwen2_vl_7b"  # a zoo spec: random weights of the published shape
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prompt_tokens: int = 256  # text tokens per prompt (approximately: whole words)
    image_size: int = 336  # one H = W image per request
    output_tokens: int = 128
    dtype: str = "bfloat16"
    hf_baseline: bool = True
    max_tokens_per_step: int = 8192
    seed: int = 0
    out_dir: str = "results/engine"


def build_random_model(model: str, seed: int, dtype: str, device: str, workdir: Path):
    """The transformers model of zoo spec `model` (random weights, on `device`) and its processor;
    `workdir` becomes a checkpoint dir without weights (config, generation config, processor)."""
    from zoo import build_model, build_processor, build_tokenizer_and_ids, get_spec

    spec = get_spec(model)
    tokenizer, ids = build_tokenizer_and_ids(spec)
    processor = build_processor(spec, tokenizer)
    hf = build_model(spec, ids, seed, dtype, device=device)
    for part in (hf.config, hf.generation_config, processor):
        part.save_pretrained(workdir)
    return hf, processor


def _prompts(job: EngineBenchJob, tokenizer, n: int, offset: int) -> list[tuple[str, np.ndarray]]:
    out = []
    for i in range(n):
        rng = np.random.default_rng(job.seed * 100003 + offset + i)
        words = []
        while len(tokenizer(" ".join(words), add_special_tokens=False)["input_ids"]) < job.prompt_tokens:
            words += list(rng.choice(WORDS, 16))
        image = rng.integers(0, 256, (job.image_size, job.image_size, 3), dtype=np.uint8)
        out.append((" ".join(words), image))
    return out


def _floor_ms(engine: Engine, context_lens: list[int], gbs: float) -> float:
    """Bytes one decode step must read (LM weights, LM head, K/V of every sequence) over the bandwidth."""
    lm = engine.model.language_model
    weights = sum(p.numel() * p.element_size() for n, p in lm.named_parameters() if not n.startswith("embed_tokens"))
    head = lm.head_weight()
    weights += 0 if lm.lm_head is not None else head.numel() * head.element_size()  # tied: the embedding is the head
    a = engine.model.args
    kv = sum(context_lens) * 2 * a.num_layers * a.num_kv_heads * a.head_dim * head.element_size()
    return (weights + kv) / (gbs * 1e9) * 1e3


def _replay_ms(engine: Engine, batch: int, context_lens: list[int], slot_ids: list[int] | None = None) -> float:
    """Device time of one decode step at these context lengths: graph replay + LM head + argmax.
    slot_ids: the adapter pool slot of each sequence (-1 = none); given, the LoRA graph replays."""
    from vlora_kernels.timing import time_op

    return time_op(replay_step(engine, batch, context_lens, slot_ids), warmup=3, repeats=20, use_graph=False) / 1e3


def replay_step(engine: Engine, batch: int, context_lens: list[int], slot_ids: list[int] | None = None):
    """The decode step `_replay_ms` times, as a callable: the graph the engine would pick, + LM head."""
    graphs = engine.runner.graphs
    bs = next(s for s in graphs.batch_sizes if s >= batch)
    graphs.slot_mapping.fill_(graphs.null_slot)  # timing must not write into cached blocks
    graphs.context_lens[:batch].copy_(torch.tensor(context_lens, dtype=torch.int32))
    graph, hidden = graphs.graphs[bs], graphs.hidden
    if slot_ids is not None and any(s >= 0 for s in slot_ids):
        from serve.lora.metadata import pick_variant

        segments, longest = graphs.lora_buffers.load(tuple(slot_ids), bs)
        graph = graphs.lora_graphs[(bs, *pick_variant(segments, longest, graphs.variants(bs)))]  # as the engine picks

    def step():
        graph.replay()
        engine.model.compute_logits(hidden[:batch]).argmax(-1)

    return step


def _run_engine(engine: Engine, job: EngineBenchJob, prompts, adapters: list[str | None] | None = None) -> dict:
    params = SamplingParams(max_tokens=job.output_tokens, ignore_eos=True, detokenize=False)
    adapters = adapters or [None] * len(prompts)
    start = time.perf_counter()
    ids = [engine.add_request(Request(prompt=text, images=[image], sampling=params, adapter=adapter))
           for (text, image), adapter in zip(prompts, adapters)]
    steps, finals = [], {}
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        steps.append((engine.step_log[-1][2] if engine.step_log else False, time.perf_counter() - t0))
        finals.update({o.request_id: o for o in outs if o.finished})
    total = time.perf_counter() - start
    ttft = [finals[i].metrics.time_to_first_token * 1e3 for i in ids]
    decode = [dt for only_decode, dt in steps if only_decode]
    prompt_lens = [finals[i].metrics.num_prompt_tokens for i in ids]
    return dict(total_s=total, ttft_ms=ttft, decode_wall_ms=statistics.median(decode) * 1e3 if decode else float("nan"),
                decode_steps=len(decode), prompt_lens=prompt_lens,
                tokens=sum(len(finals[i].token_ids) for i in ids))


def _hf_inputs(processor, prompts):
    """The batch as transformers takes it: chat template, one image each, left padding."""
    from PIL import Image

    processor.tokenizer.padding_side = "left"
    chat = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}] for text, _ in prompts]
    texts = [processor.apply_chat_template(c, add_generation_prompt=True) for c in chat]
    return processor(text=texts, images=[Image.fromarray(im) for _, im in prompts], return_tensors="pt", padding=True)


def _run_hf(hf, processor, job: EngineBenchJob, prompts) -> float:
    """Seconds for `generate` of the whole batch (greedy, fixed length)."""
    inputs = _hf_inputs(processor, prompts).to("cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        hf.generate(**inputs, max_new_tokens=job.output_tokens, min_new_tokens=job.output_tokens, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_engine_bench(job: EngineBenchJob) -> tuple[list[dict], dict]:
    """Runs every batch size; writes engine.csv and engine.json under out_dir/<gpu>/ and returns (rows, meta)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the engine benchmark needs a CUDA device")
    from vlora_kernels.timing import copy_bandwidth_gbs

    gpu = device_label("cuda")
    gbs = copy_bandwidth_gbs()
    workdir = Path(tempfile.mkdtemp(prefix="engine-bench-"))
    hf, processor = build_random_model(job.model, job.seed, job.dtype, "cuda", workdir)
    max_batch = max(job.batch_sizes)
    prompt_len = _hf_inputs(processor, _prompts(job, processor.tokenizer, 1, 0))["input_ids"].shape[1]
    per_seq = prompt_len + job.output_tokens + 32  # K/V slots one request needs (a few words of slack)
    config = EngineConfig(device="cuda", dtype=job.dtype, max_batch_size=max_batch,
                          max_tokens_per_step=job.max_tokens_per_step, num_kv_blocks=max_batch * per_seq // 16 + 64,
                          graph_batch_sizes=tuple(sorted(set(job.batch_sizes) | {1, 2, 4, 8, 16, 32, 64})),
                          encoder_cache_items=0, enable_prefix_cache=False, seed=job.seed,
                          adapter_slots=0)  # the base engine: no adapter pool (bench/adapters.py has one)
    t0 = time.perf_counter()
    engine = Engine(workdir, config, weights=dict(hf.state_dict()))
    load_s = time.perf_counter() - t0
    _run_engine(engine, dataclasses.replace(job, output_tokens=4), _prompts(job, engine.tokenizer, 2, 10**6))  # warm-up
    rows = []
    for b in job.batch_sizes:
        prompts = _prompts(job, engine.tokenizer, b, 1000 * b)
        run = _run_engine(engine, job, prompts)
        mid = [n + job.output_tokens // 2 for n in run["prompt_lens"]]
        replay_ms, floor_ms = _replay_ms(engine, b, mid), _floor_ms(engine, mid, gbs)
        hf_s = _run_hf(hf, processor, job, prompts) if job.hf_baseline else float("nan")
        ours_tps = run["tokens"] / run["total_s"]
        hf_tps = b * job.output_tokens / hf_s
        row = dict(gpu=gpu, model=job.model, batch=b, prompt_tokens=statistics.mean(run["prompt_lens"]),
                   output_tokens=job.output_tokens, ttft_ms_mean=statistics.mean(run["ttft_ms"]),
                   ttft_ms_max=max(run["ttft_ms"]), decode_step_ms=replay_ms, decode_floor_ms=floor_ms,
                   step_over_floor=replay_ms / floor_ms, decode_wall_ms=run["decode_wall_ms"],
                   decode_tokens_per_s=b / (run["decode_wall_ms"] / 1e3),
                   overhead_frac=1 - replay_ms / run["decode_wall_ms"], e2e_tokens_per_s=ours_tps,
                   hf_tokens_per_s=hf_tps, speedup_vs_hf=ours_tps / hf_tps)
        rows.append(row)
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              file=sys.stderr, flush=True)
    meta = dict(gpu=gpu, date=time.strftime("%Y-%m-%d"), copy_gbs=gbs, engine_load_s=load_s,
                torch=torch.__version__, transformers=__import__("transformers").__version__,
                triton=__import__("triton").__version__, job=dataclasses.asdict(job),
                graph_steps=engine.stats().graph_steps, eager_steps=engine.stats().eager_steps)
    _write(rows, meta, results_dir(job.out_dir, gpu))
    return rows, meta


def _write(rows: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "engine.csv", rows)
    write_json(out / "engine.json", {"meta": meta, "rows": rows})
    cols = ("batch", "ttft_ms_mean", "decode_step_ms", "decode_floor_ms", "step_over_floor", "decode_wall_ms",
            "decode_tokens_per_s", "e2e_tokens_per_s", "hf_tokens_per_s", "speedup_vs_hf")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
