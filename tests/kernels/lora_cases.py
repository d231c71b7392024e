"""Random LoRA pools and batches for the kernel tests (never zeros: they hide unwritten outputs)."""

from __future__ import annotations

import torch

from vlora_kernels.segments import build_segments

# Compiled kernels on a GPU when there is one; the Triton interpreter on CPU otherwise.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_pool(n_slots, slices, k, max_rank, dtype, seed, rank_choices=None, untargeted=0.0, device=DEVICE):
    """(lora_a, lora_b, ranks, scales) with ranks drawn per slot and slice; columns past a rank are zero."""
    g = torch.Generator().manual_seed(seed)
    n_slices, n_total = len(slices), sum(slices)
    choices = rank_choices or list(range(1, max_rank + 1))
    ranks = torch.tensor([[choices[int(torch.randint(len(choices), (1,), generator=g))] for _ in range(n_slots)]
                          for _ in range(n_slices)], dtype=torch.int32)
    if untargeted:
        ranks[torch.rand(ranks.shape, generator=g) < untargeted] = 0
    lora_a = torch.randn(n_slices, n_slots, max_rank, k, generator=g) / k**0.5
    lora_b = torch.randn(n_slots, n_total, max_rank, generator=g) / max_rank**0.5
    col = torch.arange(max_rank)
    start = 0
    for i, width in enumerate(slices):
        keep = col[None, :] < ranks[i][:, None].long()  # [slots, R]
        lora_a[i] *= keep[:, :, None]
        lora_b[:, start:start + width] *= keep[:, None, :]
        start += width
    scales = torch.rand(n_slots, generator=g) + 0.5
    to = dict(device=device)
    return (lora_a.to(dtype=dtype, **to), lora_b.to(dtype=dtype, **to), ranks.to(**to), scales.to(**to))


def make_batch(n_tokens, k, n_total, slot_ids, dtype, seed, device=DEVICE, **meta_kw):
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n_tokens, k, generator=g).to(dtype=dtype, device=device)
    y = torch.randn(n_tokens, n_total, generator=g).to(dtype=dtype, device=device)
    return x, y, build_segments(slot_ids, device=device, **meta_kw)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "NaN or inf in the output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))
