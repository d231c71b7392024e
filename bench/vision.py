"""`vlora bench bench.suite=vision`: the Qwen vision path per camera chunk, ours against transformers.

Per batch of N chunks (each `frames` frames of `image_size`^2, i.e. frames / 2 frame groups):
- tower GPU ms per chunk: the transformers tower (one attention per frame group per layer) and
  ours (`serve/models/qwen_vision.py`) with batched and varlen segment attention, CUDA-event
  medians after warm-up, with the achieved TFLOP/s from the analytic count;
- host syncs in our tower's step (layout + forward), counted by torch's sync debug mode;
- host CPU ms per chunk of the prompt path as the server runs it on JPEG frames: the processor
  (decode + preprocessing on the host) against `pixels="device"` (header, hashes, tokens);
- device ms per chunk of the deferred pixels (nvJPEG decode when torchvision has it, resize,
  normalise, patchify), batched as the encoder batches them;
- with `profile=true`, the tower's kernels by kind, SDPA backends, a CUDA-graph replay and each
  linear's GEMM in bf16 and FP8 (bench/vision_profile.py), written to `vision_profile.json`;
- with `tower_lora=true`, what LoRA on the tower costs (bench/vision_lora.py): the pass with a
  rank-`tower_lora_rank` adapter on every item, and with items of `tower_lora_adapters` adapters.
Random weights of the zoo's full-size spec; nothing is downloaded.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from vlora_kernels.timing import host_syncs, time_op
from serve.orchestrator.profile import time_call_ms

from .results import device_label, results_dir, write_csv, write_json


@dataclass
class VisionBenchJob:
    model: str = "qwen2_vl_7b"
    device: str = "cuda"
    dtype: str = "bfloat16"
    frames: int = 6
    image_size: int = 448
    chunks: tuple[int, ...] = (1, 8, 32, 64)
    repeats: int = 10
    cpu_repeats: int = 20
    seed: int = 0
    tower_lora: bool = False  # also time the tower with LoRA adapters on it (bench/vision_lora.py)
    tower_lora_rank: int = 16
    tower_lora_adapters: int = 4  # adapters the mixed pass spreads its items over
    profile: bool = False  # where the tower's time goes, and candidate speed-ups (bench/vision_profile.py)
    profile_chunks: int = 8  # chunks per profiled tower call
    profile_repeats: int = 5
    out_dir: str = "results/vision"
    command: str | None = None


def _tower_flops(vc, arch: str, grids) -> float:
    gated = arch == "qwen2_5_vl"
    d = vc.hidden_size if gated else vc.embed_dim
    hidden = vc.intermediate_size if gated else int(vc.embed_dim * vc.mlp_ratio)
    out = vc.out_hidden_size if gated else vc.hidden_size
    rows = sum(t * h * w for t, h, w in grids)
    seg = sum(t * (h * w) ** 2 for t, h, w in grids)  # full attention within frame groups (upper bound)
    mlp = (3 if gated else 2) * d * hidden
    per_layer = 2 * rows * (4 * d * d + mlp) + 4 * seg * d
    merger = 2 * (rows // 4) * (16 * d * d + 4 * d * out)
    return vc.depth * per_layer + 2 * rows * d * vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2 + merger


def _time_gpu(fn, repeats: int) -> float:
    """Median ms of fn: CUDA events on a GPU (vlora_kernels.timing, no graph: the step has host work),
    the host clock otherwise."""
    if not torch.cuda.is_available():
        return time_call_ms(fn, 1, repeats)
    return time_op(fn, warmup=1, repeats=repeats, use_graph=False) / 1e3


def towers(vc, arch: str, device, dtype: torch.dtype):
    """(the transformers tower with random weights, ours with the same weights) of a Qwen vision
    config: the reference every comparison of ours is made against (SDPA attention)."""
    from serve.models.qwen_vision import QwenVisionTower

    if arch == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Ref
    else:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as Ref
    vc._attn_implementation = "sdpa"
    with torch.device(device):
        reference = Ref._from_config(vc, dtype=dtype).eval()
        ours = QwenVisionTower(vc, arch).to(dtype).eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def _checkpoint_dir(spec, tmp: Path):
    """Config and processor files of the spec (no weights): what the prompt path reads."""
    from zoo.build import build_processor, build_tokenizer_and_ids
    from zoo.configs import hf_config

    tok, ids = build_tokenizer_and_ids(spec)
    config = hf_config(spec, ids)
    config.save_pretrained(tmp)
    build_processor(spec, tok).save_pretrained(tmp)
    return config


def _jpeg_chunk(rng, job: VisionBenchJob) -> list[bytes]:
    import cv2

    base = rng.integers(0, 256, (job.image_size // 8, job.image_size // 8, 3), dtype=np.uint8)
    frames = []
    for i in range(job.frames):  # smooth content (camera-like JPEG sizes), moving a little per frame
        frame = cv2.resize(np.roll(base, i, axis=1), (job.image_size, job.image_size), interpolation=cv2.INTER_CUBIC)
        frames.append(cv2.imencode(".jpg", frame, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes())
    return frames


def run_vision_bench(job: VisionBenchJob) -> tuple[list[dict], dict]:
    from zoo.specs import get_spec

    from serve.models import read_model_args
    from serve.models.deferred import materialize
    from serve.models.processing import PromptProcessor
    from serve.models.vision import split_frame_groups

    spec = get_spec(job.model)
    if spec.arch == "llava":
        raise SystemExit("bench.suite=vision measures the Qwen towers; pick a qwen2_vl / qwen2_5_vl model")
    device, dtype = torch.device(job.device), getattr(torch, job.dtype)
    torch.manual_seed(job.seed)
    rng = np.random.default_rng(job.seed)
    with tempfile.TemporaryDirectory() as tmp:
        config = _checkpoint_dir(spec, Path(tmp))
        args, _ = read_model_args(tmp)
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(tmp, local_files_only=True)
    host, deferred = PromptProcessor(processor, args, "host"), PromptProcessor(processor, args, "device")
    if deferred.pixel_spec is None:
        raise SystemExit("the device pixel path does not reproduce this processor (see the warning above)")
    vc = config.vision_config
    reference, ours = towers(vc, spec.arch, device, dtype)

    chunk = _jpeg_chunk(rng, job)
    prompt = "How many vehicles are in this clip?"
    cpu = {"host_ms": time_call_ms(lambda: host.process(prompt, video=chunk), 1, job.cpu_repeats),
           "device_path_host_ms": time_call_ms(lambda: deferred.process(prompt, video=chunk), 1,
                                                        job.cpu_repeats)}
    item = deferred.process(prompt, video=chunk).vision[0]
    groups = split_frame_groups([item], args.spatial_merge_size ** 2)
    rows = []
    for n in job.chunks:
        items = groups * n
        grids = [g.grid_thw for g in items]
        flops = _tower_flops(vc, spec.arch, grids)
        pixels = torch.cat(materialize([g.deferred for g in items], device, dtype))
        grid_t = torch.tensor(grids, device=device)
        row = {"chunks": n, "frame_groups": len(items), "patch_rows": pixels.shape[0],
               "tflop_per_chunk": flops / n / 1e12}
        with torch.no_grad():
            row["pixels_ms_per_chunk"] = _time_gpu(
                lambda: materialize([g.deferred for g in items], device, dtype), job.repeats) / n
            row["transformers_ms_per_chunk"] = _time_gpu(lambda: reference(pixels, grid_thw=grid_t), job.repeats) / n
            for fused in (False, True):  # eager elementwise kernels, then compiled ones (GPU)
                ours.compiled = fused
                for mode in ("batched", "varlen"):
                    ours.attention = mode
                    try:
                        ms = _time_gpu(lambda: ours(pixels, ours.layout(grids)), job.repeats) / n
                    except ValueError:  # no varlen kernel in this torch
                        ms = float("nan")
                    row[f"ours_{mode}{'_fused' if fused else ''}_ms_per_chunk"] = ms
            ours.attention = "auto"
            row["ours_syncs_per_step"] = (host_syncs(lambda: ours(pixels, ours.layout(grids)))[0]
                                          if device.type == "cuda" else None)
            got = ours(pixels, ours.layout(grids)).float()
            want = getattr(out := reference(pixels, grid_thw=grid_t), "pooler_output", out).float()
            row["rel_diff_vs_transformers"] = float((got - want).norm() / want.norm())
            if job.tower_lora:
                from .vision_lora import time_tower_lora

                ours.compiled = False
                row.update(time_tower_lora(ours, pixels, grids, job.tower_lora_rank, job.tower_lora_adapters,
                                           lambda fn: _time_gpu(fn, job.repeats) / n))
                print(f"[vision] {n} chunks: tower LoRA rank {job.tower_lora_rank} x{row['tower_lora_overhead']:.2f} "
                      f"(one adapter), x{row['tower_lora_mixed_overhead']:.2f} ({job.tower_lora_adapters} adapters) "
                      f"over {row['tower_ms_per_chunk_no_lora']:.2f} ms/chunk", flush=True)
        best = min(v for k, v in row.items() if k.startswith("ours_") and k.endswith("ms_per_chunk") and v == v)
        row["speedup"] = row["transformers_ms_per_chunk"] / best
        row["ours_tflops"] = flops / n / (best * 1e-3) / 1e12
        rows.append(row)
        print(f"[vision] {n} chunks: transformers {row['transformers_ms_per_chunk']:.2f} ms/chunk, ours "
              f"{row['ours_batched_ms_per_chunk']:.2f} (batched) / {row['ours_varlen_ms_per_chunk']:.2f} (varlen) / "
              f"{row['ours_batched_fused_ms_per_chunk']:.2f} (batched, fused), "
              f"{row['ours_tflops']:.0f} TFLOP/s, pixels {row['pixels_ms_per_chunk']:.2f} ms/chunk, "
              f"syncs {row['ours_syncs_per_step']}", flush=True)
    profile = _profile(job, ours, groups, device, dtype) if job.profile else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {"device": name, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "job": asdict(job), "cpu_per_chunk": cpu, "jpeg_bytes_per_chunk": sum(len(f) for f in chunk)}
    print(f"[vision] host CPU per chunk: processor {cpu['host_ms']:.2f} ms, device path {cpu['device_path_host_ms']:.2f} ms",
          flush=True)
    out = results_dir(job.out_dir, device_label(device))
    write_csv(out / "vision.csv", rows)
    write_json(out / "vision.json", {"meta": meta, "rows": rows})
    if profile is not None:
        meta["profile"] = profile
        write_json(out / "vision_profile.json", {"meta": {k: v for k, v in meta.items() if k != "profile"},
                                                 "profile": profile})
    return rows, meta


def _profile(job: VisionBenchJob, tower, groups, device, dtype) -> dict:
    from serve.models.deferred import materialize

    from .vision_profile import profile_lines, profile_tower

    items = groups * job.profile_chunks
    pixels = torch.cat(materialize([g.deferred for g in items], device, dtype))
    with torch.no_grad():
        result = profile_tower(tower, pixels, [g.grid_thw for g in items], job.profile_chunks, job.profile_repeats,
                               lambda fn: _time_gpu(fn, job.repeats))
    for line in profile_lines(result):
        print(line, flush=True)
    return result
