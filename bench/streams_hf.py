"""The streams evaluation's yardsticks: FLOPs per chunk, the device's dense matmul rate, and plain
Hugging Face transformers `generate` on the same chunks.

FLOPs per chunk, from parameter counts (attention-score FLOPs and elementwise work left out, so
the fraction of the matmul rate it gives is a slight underestimate):

    vision   = 2 * P_vision * patches           (patches = t * h * w of video_grid_thw; the patch
                                                 merger's parameters count once per 2 x 2 merged group)
    head     = vision + 2 * P_lm * prompt_tokens
    generate = vision + 2 * P_lm * (prompt_tokens + answer_tokens - 1) + 2 * P_lm_head * answer_tokens

P_lm: the language model's decoder layers and final norm (no token embedding, which is a lookup,
and no LM head, which runs on the last position only); P_lm_head: the output projection.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch


def _messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": prompt}]}]


def hf_inputs(processor, prompt: str, chunks: list[np.ndarray]):
    """A batch of chunks as transformers takes it: chat template with one video each, left padding."""
    processor.tokenizer.padding_side = "left"
    text = processor.apply_chat_template(_messages(prompt), add_generation_prompt=True)
    return processor(text=[text] * len(chunks), videos=list(chunks), return_tensors="pt", padding=True)


def param_counts(hf) -> dict[str, int]:
    """P_vision (merger scaled down by merge_size^2), P_lm and P_lm_head of a transformers VLM."""
    head = hf.get_output_embeddings().weight
    merge2 = getattr(hf.config.vision_config, "spatial_merge_size", 2) ** 2
    vision = lm = 0.0
    for name, p in hf.named_parameters():
        if "visual" in name:
            vision += p.numel() / (merge2 if ".merger." in name else 1)
        elif "embed_tokens" not in name and p is not head and "lm_head" not in name:
            lm += p.numel()
    return {"vision": int(vision), "lm": int(lm), "lm_head": head.numel()}


def chunk_flops(hf, processor, job, chunk: np.ndarray) -> dict:
    """Prompt tokens, patches, parameter counts and FLOPs per chunk of each mode (see the module doc)."""
    inputs = hf_inputs(processor, job.prompt, [chunk])
    tokens = int(inputs["input_ids"].shape[1])
    patches = int(inputs["video_grid_thw"].prod())
    p = param_counts(hf)
    vision = 2 * p["vision"] * patches
    a = job.answer_tokens
    return {"prompt_tokens": tokens, "patches": patches, "params_vision": p["vision"], "params_lm": p["lm"],
            "params_lm_head": p["lm_head"], "vision": float(vision),
            "head": float(vision + 2 * p["lm"] * tokens),
            "generate": float(vision + 2 * p["lm"] * (tokens + a - 1) + 2 * p["lm_head"] * a)}


def matmul_tflops(job) -> float:
    """Dense matmul rate of the device in the job's dtype, TFLOP/s (cpu: a smaller float32 product)."""
    if job.device.startswith("cuda"):
        from vlora_kernels.timing import matmul_tflops as cuda_rate

        with torch.cuda.device(torch.device(job.device)):
            return cuda_rate(job.matmul_n, getattr(torch, job.dtype))
    n = min(job.matmul_n, 1024)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    times = []
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e12


def hf_chunks_per_s(hf, processor, job, chunks: list[np.ndarray]) -> dict:
    """transformers `generate` (greedy, exactly answer_tokens new tokens) on `hf_batch` chunks at a
    time: one warm-up batch, then `hf_batches` timed ones. chunks_per_s counts `generate` alone (the
    inputs preprocessed beforehand); chunks_per_s_with_preprocess adds the processor's time."""
    device = hf.device
    n = job.answer_tokens

    def batch(b: int):
        picked = [chunks[(b * job.hf_batch + j) % len(chunks)] for j in range(job.hf_batch)]
        start = time.perf_counter()
        inputs = hf_inputs(processor, job.prompt, picked).to(device)
        return inputs, time.perf_counter() - start

    def generate(inputs) -> float:
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _sync(device)
        if out.shape[1] - inputs["input_ids"].shape[1] != n:
            raise RuntimeError(f"transformers generated {out.shape[1] - inputs['input_ids'].shape[1]} tokens, "
                               f"not the {n} asked for")
        return time.perf_counter() - start

    generate(batch(job.hf_batches)[0])  # warm-up on a batch the timed ones do not repeat first
    gen_s = prep_s = 0.0
    for b in range(job.hf_batches):
        inputs, prep = batch(b)
        gen_s += generate(inputs)
        prep_s += prep
    total = job.hf_batch * job.hf_batches
    return {"batch": job.hf_batch, "chunks": total, "generate_s": gen_s, "preprocess_s": prep_s,
            "chunks_per_s": total / gen_s, "chunks_per_s_with_preprocess": total / (gen_s + prep_s),
            "answer_tokens": n}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
