"""Tensor-parallel benchmark (`vlora bench bench.suite=tp`): parity and speed of TP=N against one GPU.

A zoo model of the published shape (random weights, bf16) is written once as a checkpoint under
`work_dir` (kept: a rerun reuses it), with `adapters` random PEFT adapters (rank `rank`, all seven
projections, one seed each). One engine (TP=1, in this process), then each size in `sizes` as a
LocalGroup (rank 0 here, the followers load the checkpoint by path: bench/tp_rank.py) run:

- parity: the same greedy sequence of runs (bench/tp_parity.py: unmerge, mixture, merge, and a
  switch back and to another adapter), TP=N against TP=1: logits up to the first divergence,
  token agreement, each divergence with the TP=1 margin there (near-ties show as small margins);
- timing: the decode step at each batch (the CUDA graph the engine replays plus the LM head, as
  bench/fp8.py times it; the engine's wall time per decode step beside it), prefill of `prompts`
  prompts with an image each (wall ms), the vision encoder on `vision_images` pictures (on a group
  both ways, EngineConfig.tp_vision split and whole; the split one broken down per rank and one call
  of it profiled on rank 0: bench/tp_vision.py) and, on a GPU, NCCL's share of a profiled decode step;
- last, when time is left: a float32 TP=1 engine runs the same sequence, and TP=1 and each TP=N
  are compared with it: bf16's own noise beside the TP error (`fp32_reference`).

Every section is written (tp.csv, tp.json, tp.md under out_dir/<device>/) as soon as it is
measured, so a run cut short keeps what it measured; a rerun skips sections tp.json already holds
(`fresh=true` measures all again). `budget_s` bounds the whole run and `section_s` each timing
section: what would start past them is skipped and named in tp.md.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .adapter_parts import ALL_MODULES
from .results import device_label, results_dir
from .tp_report import RESUME_KEYS, write_report

SHAPES = {"7b": "qwen2_vl_7b", "2b": "qwen2_vl_2b", "tiny": "qwen2_vl_tiny"}


@dataclass
class TpBenchJob:
    shape: str = "7b"  # 7b | 2b | tiny, or a zoo spec name (random weights of that shape)
    device: str = "cuda"  # cpu: gloo ranks (shape=tiny dtype=float32)
    dtype: str = "bfloat16"
    sizes: tuple[int, ...] = (2,)  # TP sizes measured against TP=1
    batches: tuple[int, ...] = (1, 32, 64)  # decode step batch sizes
    prompts: int = 16  # parity and prefill prompts: text + one image each
    prompt_tokens: int = 128
    image_size: int = 336
    output_tokens: int = 24  # greedy tokens per parity prompt, no early stop
    adapters: int = 3  # random PEFT adapters (2..4), rank `rank` on `modules`
    rank: int = 16
    modules: tuple[str, ...] = ALL_MODULES
    decode_context: int = 512  # context tokens per sequence in the replayed decode step
    decode_tokens: int = 16  # tokens per request in the wall-time decode runs
    repeats: int = 20  # timed replays per decode step
    vision_images: int = 32
    vision_repeats: int = 10
    profile: bool = True  # GPU: NCCL's share of a profiled decode step at each batch
    fp32_reference: bool = True  # a float32 TP=1 engine runs the parity sequence last (bf16 noise)
    budget_s: float = 480.0  # the whole run; sections that would start later are skipped
    section_s: float = 120.0  # each timing section; its remaining batches are skipped past it
    work_dir: str = ".vlora/bench_tp"  # the checkpoint and adapters (kept; not under out_dir)
    threads: int | None = None  # torch threads per rank (None: torch's default)
    fresh: bool = False  # true: measure every section again
    seed: int = 0
    out_dir: str = "results/bench/tp"
    command: str = ""


def model_name(shape: str) -> str:
    return SHAPES.get(shape, shape)


def check_job(job: TpBenchJob) -> None:
    """Bad options, refused with one line each before any model is built."""
    from serve.distributed import check_divisible
    from zoo import get_spec

    try:
        spec = get_spec(model_name(job.shape))
    except (KeyError, ValueError) as e:
        raise ValueError(f"bench.tp.shape={job.shape!r}: not one of {sorted(SHAPES)} nor a zoo spec ({e})") from None
    if not job.sizes or any(not isinstance(n, int) or n < 2 for n in job.sizes):
        raise ValueError(f"bench.tp.sizes={list(job.sizes)}: TP sizes of 2 or more (TP=1 always runs as the reference)")
    for n in job.sizes:
        try:
            check_divisible(spec.text, n)
        except ValueError as e:
            raise ValueError(f"bench.tp.sizes: {n} does not split {spec.name}: {e}") from None
    if job.device.startswith("cuda"):
        visible = torch.cuda.device_count()
        if max(job.sizes) > visible:
            raise ValueError(f"bench.tp.sizes={list(job.sizes)}: TP={max(job.sizes)} needs {max(job.sizes)} GPUs, "
                             f"this process sees {visible}")
    elif job.device != "cpu":
        raise ValueError(f"bench.tp.device={job.device!r}: cuda or cpu")
    if job.dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"bench.tp.dtype={job.dtype!r}: bfloat16, float16 or float32")
    if not 2 <= job.adapters <= 4:
        raise ValueError(f"bench.tp.adapters={job.adapters}: 2 to 4 (mixed requests and a switch between two)")
    if not job.batches or min(job.batches) < 1 or job.prompts < 1 or job.output_tokens < 1:
        raise ValueError(f"bench.tp: batches ({list(job.batches)}), prompts ({job.prompts}) and output_tokens "
                         f"({job.output_tokens}) must be >= 1")
    if Path(job.work_dir).resolve().is_relative_to(Path(job.out_dir).resolve()):
        raise ValueError(f"bench.tp.work_dir={job.work_dir!r} is under out_dir: the checkpoint would be "
                         "copied with the results")


class Clock:
    def __init__(self, budget_s: float):
        self.start, self.budget = time.monotonic(), budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget - self.elapsed()


def _log(clock: Clock, msg: str) -> None:
    print(f"[tp bench +{clock.elapsed():.0f}s] {msg}", file=sys.stderr, flush=True)


def _prepare(job: TpBenchJob, clock: Clock):
    """The checkpoint and adapters under work_dir (kept), the prompt length, the K/V blocks."""
    from serve.models import read_model_args
    from zoo import build_checkpoint, build_processor, build_tokenizer_and_ids, get_spec

    from .adapter_parts import write_peft_adapter
    from .engine import _hf_inputs, _prompts
    from .tp_parity import ADAPTER_NAMES

    name = model_name(job.shape)
    work = Path(job.work_dir)
    ckpt = build_checkpoint(name, work / f"{name}-seed{job.seed}", seed=job.seed,
                            device="cuda" if job.device.startswith("cuda") else "cpu")
    _free(job.device)  # the model drawn on the GPU to write it
    _log(clock, f"checkpoint {ckpt}")
    args = read_model_args(ckpt)[0]
    adapters = {}
    for i, a in enumerate(ADAPTER_NAMES[:job.adapters]):
        path = work / f"adapter-{a}-r{job.rank}-seed{job.seed + 1 + i}"
        if not (path / "adapter_config.json").exists():
            write_peft_adapter(path, args, job.rank, tuple(job.modules), job.seed + 1 + i, torch.bfloat16,
                               job.device if job.device.startswith("cuda") else "cpu")
        adapters[a] = str(path)
    _log(clock, f"adapters {', '.join(adapters)} (rank {job.rank}, {len(job.modules)} projections)")
    spec = get_spec(name)
    tokenizer, _ = build_tokenizer_and_ids(spec)
    processor = build_processor(spec, tokenizer)
    prompt_len = _hf_inputs(processor, _prompts(job, tokenizer, 1, 0))["input_ids"].shape[1]
    per_seq = max(prompt_len + max(job.output_tokens, job.decode_tokens), job.decode_context) + 32
    kv_blocks = max(job.batches + (job.prompts,)) * per_seq // 16 + 64
    return str(ckpt), adapters, prompt_len, kv_blocks, args


def engine_config(job: TpBenchJob, adapters: dict, kv_blocks: int, tp: int, dtype: str) -> dict:
    cuda = job.device.startswith("cuda")
    largest = max(job.batches + (job.prompts,))
    graphs = tuple(sorted(set(job.batches) | {s for s in (1, 2, 4, 8, 16, 32, 64) if s <= largest}))
    return dict(device=job.device, dtype=dtype, max_batch_size=largest, max_tokens_per_step=8192,
                num_kv_blocks=kv_blocks, cuda_graphs=cuda and dtype != "float32", graph_batch_sizes=graphs,
                encoder_cache_items=0, enable_prefix_cache=False, seed=job.seed, warm_up="off", encode_ahead="off",
                vision_compile=False,  # the tower's compile is no part of what is measured, and costs minutes
                adapter_slots=len(adapters), host_adapter_cache=len(adapters), max_lora_rank=job.rank,
                lora_targets=tuple(job.modules), adapters=tuple(f"{n}={p}" for n, p in adapters.items()),
                tensor_parallel_size=tp)


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _load_done(out: Path, job: TpBenchJob) -> tuple[list[dict], dict]:
    """Rows and meta of an earlier run of the same measurement (tp.json), unless fresh."""
    path = out / "tp.json"
    if job.fresh or not path.exists():
        return [], {}
    old = json.loads(path.read_text())
    mine = json.loads(json.dumps(dataclasses.asdict(job)))  # tuples as the file holds them: lists
    same = all(old["meta"]["job"].get(k) == mine[k] for k in RESUME_KEYS)
    return (old["rows"], old["meta"]) if same else ([], {})


def run_tp_bench(job: TpBenchJob) -> tuple[list[dict], dict]:
    """Writes tp.csv, tp.json and tp.md under out_dir/<device>/ (after every section); (rows, meta)."""
    from .tp_sections import run_sections

    check_job(job)
    clock = Clock(job.budget_s)
    label = device_label(job.device if job.device.startswith("cuda") else "cpu")
    out = results_dir(job.out_dir, label)
    rows, earlier = _load_done(out, job)
    meta = dict(device=label, gpus=torch.cuda.device_count() if job.device.startswith("cuda") else 0,
                date=time.strftime("%Y-%m-%d"), torch=torch.__version__, model=model_name(job.shape),
                job=dataclasses.asdict(job), notes=list(earlier.get("notes", [])),
                seconds={k if k.startswith("earlier ") else f"earlier {k}": v
                         for k, v in earlier.get("seconds", {}).items()})
    if rows:
        _log(clock, f"resuming: {len(rows)} rows of {out / 'tp.json'} kept")

    def save(new_rows: list[dict]) -> None:
        rows.extend(new_rows)
        meta["seconds"]["total"] = clock.elapsed()
        write_report(rows, meta, out, echo=False)

    t0 = time.monotonic()
    ckpt, adapters, meta["prompt_len"], kv_blocks, args = _prepare(job, clock)
    meta["seconds"]["prepare"] = time.monotonic() - t0
    meta["layers"] = args.num_layers
    run_sections(job, clock, rows, meta, save, ckpt, adapters, kv_blocks, lambda m: _log(clock, m))
    meta["seconds"]["total"] = clock.elapsed()
    write_report(rows, meta, out, echo=True)
    return rows, meta
