"""The training benchmark's baseline and the parts both methods share (bench/train.py runs them).

- `make_rows`: a synthetic counting domain rendered with numpy (coloured squares on a noisy
  background; "How many squares ...?" -> "3"), in the row schema of `train/data.py`.
- `batch_order`: the row indices of every step, one permutation per epoch of (seed, epoch) as
  `train_adapter` draws them, so both methods see the same rows in the same order.
- `run_steps`: the timed loop both methods go through (warm-up steps untimed, device synced
  around every step, the rows each step consumed recorded for the same-batches check).
- `step_flops` (the formula: FLOPS), `matmul_peak_tflops`, `summarize` and `print_table`: what
  the rows are measured against and how they are reported.
- `run_plain`: what a user writes with transformers + PEFT alone: the checkpoint through
  `AutoModelForImageTextToText`, `get_peft_model`, the processor's full inputs per step (the
  vision tower runs every step), `model(**inputs).loss`, AdamW.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
import warnings
from dataclasses import asdict

import numpy as np
import torch

QUESTION = "How many squares are in the image?"
ANSWER_END = "<|im_end|>"  # Qwen's end of turn: the token the answer is trained to stop with
FLOPS = ("per timed step, from the text config (N = the language model's linear weights, r = LoRA rank, "
         "T = real tokens, s = each sequence's length): frozen base 2NT forward + 2NT backward (activation "
         "grads only); LoRA 6 r (d_in + d_out) T per adapted linear (forward, activation and weight grads); "
         "attention 12 L q s^2 (4 forward, 8 backward; q = heads x head_dim); LM head 4 V D T when logits are "
         "taken; count head 12 D T; plus the vision tower's forward for each item it ran on (plain: every item; "
         "ours: feature-cache misses). Gradient-checkpointing recomputation is not counted (model FLOPs).")


def make_rows(n: int, image_size: int, max_count: int, seed: int) -> list[dict]:
    from PIL import Image

    rows = []
    side = max(image_size // 10, 4)
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        image = rng.integers(0, 64, (image_size, image_size, 3), dtype=np.uint8)
        count = int(rng.integers(0, max_count + 1))
        for _ in range(count):
            y, x = rng.integers(0, image_size - side, 2)
            image[y:y + side, x:x + side] = rng.integers(128, 256, 3, dtype=np.uint8)
        # prompt "" makes the Encoder render the model's own chat prompt, as the plain path does
        rows.append({"id": str(i), "media": "image", "image": Image.fromarray(image), "video": None, "frames": [],
                     "question": QUESTION, "prompt": "", "count": count, "label": None, "answer": str(count)})
    return rows


def batch_order(n_rows: int, batch_size: int, n_steps: int, seed: int) -> list[list[int]]:
    """Row indices of `n_steps` full batches, epoch after epoch (a short last batch is dropped)."""
    out, epoch = [], 0
    while len(out) < n_steps:
        order = np.random.default_rng([seed, epoch]).permutation(n_rows)
        out += [order[i:i + batch_size].tolist() for i in range(0, n_rows - batch_size + 1, batch_size)]
        epoch += 1
    return out[:n_steps]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(rows: list[dict], order: list[list[int]], warmup: int, device: torch.device, prepare, step) -> dict:
    """prepare(rows) runs untimed (a prefetching data loader's work); step(prepared) -> (loss,
    per-sample token counts, items whose vision tower ran) is timed, warm-up steps excluded."""
    losses, times, lens, vision_items, ids = [], [], [], [], []
    for i, idx in enumerate(order):
        batch_rows = [rows[j] for j in idx]
        ids.append(",".join(r["id"] for r in batch_rows))
        prepared = prepare(batch_rows)
        sync(device)
        t0 = time.perf_counter()
        loss, n_tokens, n_vision = step(prepared)
        loss = float(loss)  # waits for the step's work too
        sync(device)
        dt = time.perf_counter() - t0
        losses.append(loss)
        if i >= warmup:
            times.append(dt)
            lens.append(n_tokens)
            vision_items.append(n_vision)
    return {"losses": losses, "times": times, "lens": lens, "vision_items": vision_items,
            "batches_sha": hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16],
            "step_ms_median": 1e3 * statistics.median(times), "step_ms_mean": 1e3 * statistics.mean(times)}


def plain_batch(processor, rows: list[dict]) -> dict[str, torch.Tensor]:
    """The processor's inputs for prompt + answer per row, right-padded; labels mask the prompt."""
    items = []
    for r in rows:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": r["question"]}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        enc = processor(text=[prompt], images=[r["image"]], return_tensors="pt")
        answer = processor.tokenizer(r["answer"] + ANSWER_END, add_special_tokens=False,
                                     return_tensors="pt")["input_ids"][0]
        items.append((enc, answer))
    width = max(e["input_ids"].shape[1] + a.numel() for e, a in items)
    token_keys = [k for k, v in items[0][0].items() if v.shape == items[0][0]["input_ids"].shape]
    pad = processor.tokenizer.pad_token_id or 0
    out = {k: torch.full((len(items), width), pad if k == "input_ids" else 0, dtype=torch.long) for k in token_keys}
    out["labels"] = torch.full((len(items), width), -100, dtype=torch.long)
    for i, (enc, answer) in enumerate(items):
        n, k = enc["input_ids"].shape[1], answer.numel()
        for key in token_keys:  # text after the prompt: answer ids, attended, plain text type (0)
            tail = answer if key == "input_ids" else torch.ones(k) if key == "attention_mask" else torch.zeros(k)
            out[key][i, :n + k] = torch.cat([enc[key][0], tail.to(torch.long)])
        out["labels"][i, n:n + k] = answer
    for key in ("pixel_values", "image_grid_thw"):
        out[key] = torch.cat([enc[key] for enc, _ in items])
    return out


def run_plain(job, name: str, path: str, rows: list[dict], order: list[list[int]], seed: int,
              device: torch.device) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from train.model import target_regex

    processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=getattr(torch, job.dtype),
                                                        local_files_only=True).to(device)
    # The same LoraConfig as ours (rank, alpha, dropout, the language model's target projections)
    # and the same seed right before it, so LoRA A starts equal.
    config = LoraConfig(r=job.rank, lora_alpha=job.alpha, lora_dropout=job.dropout, bias="none",
                        target_modules=target_regex(model.config.model_type, job.lora_spec(), False))
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # PEFT asks transformers a deprecated gradient-checkpointing question
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        model = get_peft_model(model, config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=job.lr)

    def step(inputs):
        inputs = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
        loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, job.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach(), inputs["attention_mask"].sum(dim=1).tolist(), len(inputs["image_grid_thw"])

    out = run_steps(rows, order, job.warmup, device, lambda r: plain_batch(processor, r), step)
    out["loss"] = "lm"
    return out


def step_flops(config, job, lens: list[int], loss: str, vision_items: int, item_flops: float) -> float:
    """Model FLOPs of one training step (the formula: FLOPS above)."""
    tc = config.get_text_config()
    d, n_layers, inter = tc.hidden_size, tc.num_hidden_layers, tc.intermediate_size
    hd = getattr(tc, "head_dim", None) or d // tc.num_attention_heads
    q, kv = tc.num_attention_heads * hd, tc.num_key_value_heads * hd
    dims = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)}
    n_base = n_layers * sum(i * o for i, o in dims.values())
    n_lora = n_layers * job.rank * sum(i + o for t, (i, o) in dims.items() if t in job.targets)
    tokens, squares = sum(lens), sum(s * s for s in lens)
    flops = 4 * n_base * tokens + 6 * n_lora * tokens + 12 * n_layers * q * squares
    flops += 4 * tc.vocab_size * d * tokens if loss == "lm" else 12 * d * tokens
    return flops + vision_items * item_flops


def matmul_peak_tflops(device: torch.device, n: int) -> float:
    """The device's measured dense matmul rate: bf16 n^3 on a GPU (the best of three medians: the
    first can run before the clocks have risen); a float32 512^3 on the CPU."""
    if device.type == "cuda":
        from vlora_kernels.timing import matmul_tflops

        with torch.cuda.device(device):
            return max(matmul_tflops(n, torch.bfloat16) for _ in range(3))
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    a @ b
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * 512 ** 3 / statistics.median(times) / 1e12


def num(v) -> float | None:
    return None if v in (None, "") else float(v)  # rows read back from train.csv hold strings


def summarize(rows: list[dict], pairs: dict, job, gpu: str, peak: float, ran: int, skipped: int) -> dict:
    """summary.json: the run's context and, per model, ours / plain over the seeds of this job's
    settings (`pairs`: model -> method -> its row or None per seed)."""
    import accelerate
    import peft
    import transformers

    models = {}
    for name, pair in pairs.items():
        entry = {f"{m}_status": [r and r["status"] for r in rs] for m, rs in pair.items()}
        ok = {m: [r for r in rs if r and r["status"] == "ok"] for m, rs in pair.items()}
        if ok.get("ours") and ok.get("plain"):
            def ratio(col):
                o, p = ([num(r[col]) for r in ok[m]] for m in ("ours", "plain"))
                return None if None in o + p else statistics.mean(o) / statistics.mean(p)
            entry.update(ours_over_plain_samples_per_s=ratio("samples_per_s"),
                         ours_over_plain_peak_mem=ratio("peak_mem_gib"))
            if job.loss == "lm":  # same rows, same LoRA init: the first step's LM loss must agree
                diffs = [abs(num(o["first_loss"]) - num(p["first_loss"])) / abs(num(p["first_loss"]))
                         for o, p in zip(pair["ours"], pair["plain"]) if o and p and o["status"] == p["status"] == "ok"]
                entry["first_loss_rel_diff"] = max(diffs) if diffs else None
        models[name] = entry
    return {"gpu": gpu, "date": time.strftime("%Y-%m-%d %H:%M"), "command": job.command,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "peft": peft.__version__, "accelerate": accelerate.__version__},
            "matmul_peak_tflops": peak, "flops_formula": FLOPS, "job": asdict(job), "ran": ran, "skipped": skipped,
            "models": models, "rows": rows}


def print_table(rows: list[dict]) -> None:
    cols = ("model", "method", "seed", "status", "samples_per_s", "tokens_per_s", "peak_mem_gib", "step_ms_median",
            "mfu", "first_loss")
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else "-" if v in (None, "") else str(v)
    table = [cols] + [tuple(fmt(num(r.get(c)) if c in cols[4:] else r[c]) for c in cols) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    for line in table:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths)), flush=True)
