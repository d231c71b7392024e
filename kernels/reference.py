"""Plain-PyTorch implementations of the batched LoRA op: the fp32 reference and the baselines.

All share one call signature, so tests and benchmarks swap them freely:

    fn(y, x, lora_a, lora_b, meta, ranks, scales, slices) -> y      (y += LoRA(x), in place)

    y: [T, sum(slices)]   x: [T, K]   lora_a: [slices, slots, R, K]   lora_b: [slots, sum(slices), R]
    ranks: int32 [slices, slots]   scales: float32 [slots]   meta: SegmentMeta of the batch

The baselines that gather whole pool rows (gather-BMM, einsum) rely on the pool's invariant
that rank columns past an adapter's real rank are zero.
"""

from __future__ import annotations

import torch

from .segments import SegmentMeta


def _bounds(slices: tuple[int, ...]) -> list[tuple[int, int]]:
    out, start = [], 0
    for width in slices:
        out.append((start, start + width))
        start += width
    return out


def _per_segment(y, x, lora_a, lora_b, meta: SegmentMeta, ranks, scales, slices, exact: bool):
    ranks_host, scales_host = ranks.cpu().tolist(), scales.cpu().tolist()
    order = meta.token_order.long()
    for slot, start, length in meta.host_segments:
        tokens = order[start:start + length]
        xs = x[tokens].float() if exact else x[tokens]
        for i, (lo, hi) in enumerate(_bounds(slices)):
            r = ranks_host[i][slot]
            if r == 0:
                continue
            a, b = lora_a[i, slot, :r], lora_b[slot, lo:hi, :r]
            if exact:
                delta = (xs @ a.float().T) @ b.float().T
                y[tokens, lo:hi] = (y[tokens, lo:hi].float() + scales_host[slot] * delta).to(y.dtype)
            else:
                y[tokens, lo:hi] += (xs @ a.T) @ b.T * scales_host[slot]
    return y


def lora_reference(y, x, lora_a, lora_b, meta: SegmentMeta, ranks, scales, slices):
    """Per segment, per slice, in fp32: exact up to the final rounding into y."""
    return _per_segment(y, x, lora_a, lora_b, meta, ranks, scales, slices, exact=True)


def lora_loop(y, x, lora_a, lora_b, meta: SegmentMeta, ranks, scales, slices):
    """What PEFT does for mixed batches: a loop over the adapters, two matmuls each, in x's dtype."""
    return _per_segment(y, x, lora_a, lora_b, meta, ranks, scales, slices, exact=False)


def _token_slots(meta: SegmentMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens with LoRA, their slots) as device tensors."""
    n_tokens, n_segments = sum(n for _, _, n in meta.host_segments), len(meta.host_segments)
    order = meta.token_order[:n_tokens].long()
    slots = torch.repeat_interleave(meta.seg_slot[:n_segments].long(), meta.seg_len[:n_segments].long(),
                                    output_size=n_tokens)  # size known on the host: no sync
    return order, slots


def lora_gather_bmm(y, x, lora_a, lora_b, meta: SegmentMeta, ranks, scales, slices):
    """Gather each token's adapter (padded to the pool's rank) and run batched matmuls."""
    tokens, slots = _token_slots(meta)
    xs = x[tokens].unsqueeze(1)  # [T, 1, K]
    scale = scales[slots].to(x.dtype)[:, None, None]
    for i, (lo, hi) in enumerate(_bounds(slices)):
        v = torch.bmm(xs, lora_a[i, slots].transpose(1, 2))  # [T, 1, R]
        delta = torch.bmm(v, lora_b[slots, lo:hi].transpose(1, 2)) * scale  # [T, 1, N_i]
        y[tokens, lo:hi] += delta.squeeze(1)
    return y


def lora_einsum(y, x, lora_a, lora_b, meta: SegmentMeta, ranks, scales, slices):
    """dLoRA's formulation: per-token gathered adapters contracted with einsum."""
    tokens, slots = _token_slots(meta)
    xs = x[tokens]
    scale = scales[slots].to(x.dtype)[:, None]
    for i, (lo, hi) in enumerate(_bounds(slices)):
        v = torch.einsum("tk,trk->tr", xs, lora_a[i, slots])
        y[tokens, lo:hi] += torch.einsum("tr,tnr->tn", v, lora_b[slots, lo:hi]) * scale
    return y
