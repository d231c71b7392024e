"""Plain-PyTorch implementations of the batched LoRA op: the fp32 reference and the baselines.

All share one call signature, so tests and benchmarks swap them freely:

    fn(y, x, lora_a, lora_b, meta, ranks, scales, slices) -> y      (y += LoRA(x), in place)

    y: [T, sum(slices)]   x: [T, K]   lora_a: [slices, slots, R, K]   lora_b: [slots, sum(slices), R]
    ranks: int32 [slices, slots]   scales: float32 [slots]   meta: SegmentMeta of the batch

A mixture batch (`meta.host_mix_slot` >= 0) also subtracts that slot's delta from every token of
every segment (slot -2: that part only); every implementation here honours it.

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
    mix = meta.host_mix_slot
    for slot, start, length in meta.host_segments:
        tokens = order[start:start + length]
        xs = x[tokens].float() if exact else x[tokens]
        # (slot, sign) parts of this segment: its own adapter, and in mixture the mixed-in one negated
        parts = ([(slot, 1.0)] if slot >= 0 else []) + ([(mix, -1.0)] if mix >= 0 else [])
        for i, (lo, hi) in enumerate(_bounds(slices)):
            delta = None
            for s, sign in parts:
                r = ranks_host[i][s]
                if r == 0:
                    continue
                a, b = lora_a[i, s, :r], lora_b[s, lo:hi, :r]
                if exact:
                    term = (xs @ a.float().T) @ b.float().T * (sign * scales_host[s])
                else:
                    term = (xs @ a.T) @ b.T * (sign * scales_host[s])
                delta = term if delta is None else delta + term
            if delta is None:
                continue
            if exact:  # one rounding into y, as the kernels do
                y[tokens, lo:hi] = (y[tokens, lo:hi].float() + delta).to(y.dtype)
            else:
                y[tokens, lo:hi] += delta
    return y


def lora_reference(y, x, lora_a, lora_b, meta: SegmentMeta, ranks, scales, slices):
    """Per segment, per slice, in fp32: exact up to the final rounding into y."""
    return _per_segment(y, x, lora_a, lora_b, meta, ranks, scales, slices, exact=True)


def lora_loop(y, x, lora_a, lora_b, meta: SegmentMeta, ranks, scales, slices):
    """What PEFT does for mixed batches: a loop over the adapters, two matmuls each, in x's dtype."""
    return _per_segment(y, x, lora_a, lora_b, meta, ranks, scales, slices, exact=False)


def _token_slots(meta: SegmentMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens with LoRA, their slots) as device tensors (slot -2: none of its own, in mixture)."""
    n_tokens, n_segments = sum(n for _, _, n in meta.host_segments), len(meta.host_segments)
    order = meta.token_order[:n_tokens].long()
    slots = torch.repeat_interleave(meta.seg_slot[:n_segments].long(), meta.seg_len[:n_segments].long(),
                                    output_size=n_tokens)  # size known on the host: no sync
    return order, slots


def _gathered(meta: SegmentMeta, scales):
    """(tokens, [(slots, signed scales)]) of each part: own adapters (those of slot -2 read slot 0
    with scale 0), then in mixture the mixed-in slot negated for every token."""
    tokens, slots = _token_slots(meta)
    own = slots.clamp_min(0)
    parts = [(own, torch.where(slots >= 0, scales[own], 0.0))]
    if meta.host_mix_slot >= 0:
        mix = torch.full_like(slots, meta.host_mix_slot)
        parts.append((mix, -scales[mix]))
    return tokens, parts


def lora_gather_bmm(y, x, lora_a, lora_b, meta: SegmentMeta, ranks, scales, slices):
    """Gather each token's adapter (padded to the pool's rank) and run batched matmuls."""
    tokens, parts = _gathered(meta, scales)
    xs = x[tokens].unsqueeze(1)  # [T, 1, K]
    for i, (lo, hi) in enumerate(_bounds(slices)):
        for slots, scale in parts:
            v = torch.bmm(xs, lora_a[i, slots].transpose(1, 2))  # [T, 1, R]
            delta = torch.bmm(v, lora_b[slots, lo:hi].transpose(1, 2)) * scale.to(x.dtype)[:, None, None]
            y[tokens, lo:hi] += delta.squeeze(1)
    return y


def lora_einsum(y, x, lora_a, lora_b, meta: SegmentMeta, ranks, scales, slices):
    """dLoRA's formulation: per-token gathered adapters contracted with einsum."""
    tokens, parts = _gathered(meta, scales)
    xs = x[tokens]
    for i, (lo, hi) in enumerate(_bounds(slices)):
        for slots, scale in parts:
            v = torch.einsum("tk,trk->tr", xs, lora_a[i, slots])
            y[tokens, lo:hi] += torch.einsum("tr,tnr->tn", v, lora_b[slots, lo:hi]) * scale.to(x.dtype)[:, None]
    return y
