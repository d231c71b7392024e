"""Turning a scheduled batch into model inputs: flattened token ids, positions, cache slots,
the step context, vision embeddings for the placeholder rows and the rows to sample from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from serve.models import VisionLanguageModel

from serve.forward.context import StepContext
from .encoder_cache import EncoderCache
from .sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T] or [3, T]
    context: StepContext
    sample_rows: list[int]  # rows of the last token of each sequence that samples this step
    sample_seqs: list[Sequence]
    mm_embeds: torch.Tensor | None = None  # [M, D]: rows for the M placeholder tokens, in order
    mm_mask: torch.Tensor | None = None  # bool [T]


def seq_positions(model: VisionLanguageModel, seq: Sequence, start: int, end: int) -> list:
    """Positions of tokens [start, end): a list of ints, or three lists for M-RoPE."""
    if not model.mrope:
        return list(range(start, end))
    delta = seq.state.mrope_delta
    if start >= seq.prompt_len:  # generated tokens: plain positions shifted by the prompt's delta
        row = list(range(start + delta, end + delta))
        return [row, row, row]
    return model.positions(seq.state.prompt_positions, delta, seq.prompt_len, start, end).tolist()


def build_step_inputs(model: VisionLanguageModel, entries: list[tuple[Sequence, int]], block_size: int,
                      device: torch.device) -> StepInputs:
    ids, slots, query_lens, context_lens, tables, rows, seqs = [], [], [], [], [], [], []
    pos = [[], [], []] if model.mrope else []
    row = 0
    for seq, n in entries:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        ids.extend(seq.token_ids[start:end])
        p = seq_positions(model, seq, start, end)
        if model.mrope:
            for axis in range(3):
                pos[axis].extend(p[axis])
        else:
            pos.extend(p)
        table = seq.block_table
        slots.extend(table[t // block_size] * block_size + t % block_size for t in range(start, end))
        query_lens.append(n)
        context_lens.append(end)
        tables.append(table)
        row += n
        if end == seq.num_tokens:
            rows.append(row - 1)
            seqs.append(seq)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    query_start = [0]
    for n in query_lens:
        query_start.append(query_start[-1] + n)

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    ctx = StepContext(
        slot_mapping=tensor(slots, torch.int64), query_start=tensor(query_start, torch.int32),
        context_lens=tensor(context_lens, torch.int32), block_tables=tensor(padded, torch.int32),
        max_query_len=max(query_lens), max_context_len=max(context_lens),
        decode_only=all(n == 1 for n in query_lens), query_lens_list=query_lens, context_lens_list=context_lens,
        adapters=[seq.adapter for seq, _ in entries],
    )
    return StepInputs(tensor(ids, torch.int64), tensor(pos, torch.int64), ctx, rows, seqs)


def attach_vision(model: VisionLanguageModel, inputs: StepInputs, entries: list[tuple[Sequence, int]],
                  cache: EncoderCache, max_batch: int, counters: dict) -> None:
    """Fills inputs.mm_embeds / mm_mask for placeholder tokens of this step, encoding in one batched
    tower call (per `max_batch` items) whatever neither the sequence nor the encoder cache holds."""
    needed = []  # (seq, item, first row of the seq in this step, tokens of the seq in this step)
    row = 0
    for seq, n in entries:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        for item in seq.state.vision:
            if item.offset < end and item.offset + item.num_tokens > start:
                needed.append((seq, item, row, n))
        row += n
    if not needed:
        return
    pending: dict[str, object] = {}
    for seq, item, _, _ in needed:
        held = seq.state.embeds
        if item.content_hash in held or item.content_hash in pending:
            continue
        cached = cache.get(item.content_hash)
        if cached is not None:
            held[item.content_hash] = cached
        else:
            pending[item.content_hash] = item
    fresh: dict[str, torch.Tensor] = {}
    items = list(pending.values())
    for i in range(0, len(items), max_batch):
        chunk = items[i:i + max_batch]
        for item, emb in zip(chunk, model.encode(chunk)):
            fresh[item.content_hash] = emb
            cache.put(item.content_hash, emb)
        counters["encoder_calls"] += 1
        counters["items_encoded"] += len(chunk)
    embeds, mask = [], torch.zeros(inputs.input_ids.shape[0], dtype=torch.bool)
    for seq, item, seq_row, n in needed:
        held = seq.state.embeds
        if item.content_hash not in held:
            held[item.content_hash] = fresh[item.content_hash]
        start = seq.num_computed_tokens
        lo = max(start, item.offset)
        hi = min(start + n, item.offset + item.num_tokens)
        embeds.append(held[item.content_hash][lo - item.offset:hi - item.offset])
        mask[seq_row + lo - start:seq_row + hi - start] = True
    inputs.mm_embeds = torch.cat(embeds)
    device = inputs.input_ids.device
    inputs.mm_mask = (mask.pin_memory() if device.type == "cuda" else mask).to(device, non_blocking=True)


def release_vision(entries: list[tuple[Sequence, int]]) -> None:
    """Drops a sequence's embeddings of spans its prefill has passed (the encoder cache may keep them)."""
    for seq, n in entries:
        held = seq.state.embeds
        if not held:
            continue
        end = seq.num_computed_tokens + n
        still_needed = {item.content_hash for item in seq.state.vision
                        if item.offset + item.num_tokens > end}
        for key in [k for k in held if k not in still_needed]:
            del held[key]
