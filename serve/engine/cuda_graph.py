"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (GPU only).

A decode step's shapes depend only on the batch size, so the forward is captured once per
bucket over static input buffers; a step copies its inputs into the first B rows, pads the
bucket with rows that write their K/V into the cache's scratch block, replays and reads the
first B rows of the output. The paged decode kernel takes its loop bounds from
`context_lens` in memory, so the graph replays correctly for any context lengths.
Graphs need the "triton" attention backend (the torch path loops over host lists).

With adapters, each bucket has a second graph captured with the LoRA layers active over the
fixed segment buffers of `serve.lora.LoraGraphBuffers` (the step's metadata is copied in before
the replay); steps where no token uses an adapter replay the plain graph and pay nothing. That
graph serves any mix, so its LoRA kernels are tiled as for one adapter over the whole batch and
gridded for bs adapters of bs tokens each. `lora_segments` and `lora_seg_lens` add graphs for
steps with at most s adapters and at most n tokens per adapter (every pair of bounds,
`serve.lora.metadata.graph_variants`), gridded and tiled for such a mix, and a step replays the
tightest one that holds it (`pick_variant`). With
modes enabled, a third graph per bucket holds a mixture step (each token's own adapter and deLoRA's
negated merged adapter in one LoRA call, the merged slot read from a buffer:
`serve.lora.MixtureGraphBuffers`), so decode steps in mixture mode replay too instead of running
eagerly.
"""

from __future__ import annotations

import torch

from serve.forward.context import StepContext, step_context
from serve.lora.metadata import graph_variants, pick_variant
from serve.lora.modes import MixtureBatch
from .inputs import StepInputs
from .kv_cache import KVCache


class DecodeGraphs:
    def __init__(self, model, kv_cache: KVCache, batch_sizes: tuple[int, ...], max_blocks_per_seq: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, lora_buffers=None,
                 mixture_buffers=None, lora_segments: tuple[int, ...] = (), lora_seg_lens: tuple[int, ...] = ()):
        self.model = model
        self.lora_buffers = lora_buffers  # serve.lora.LoraGraphBuffers, or None: LoRA steps run eagerly
        self.mixture_buffers = mixture_buffers  # serve.lora.MixtureGraphBuffers, or None: mixture runs eagerly
        self.batch_sizes = tuple(sorted(batch_sizes))
        # each bucket's LoRA graphs as (adapters, tokens per adapter) bounds, fixed here because
        # every decode step picks among them
        self._variants = {} if lora_buffers is None else {
            bs: graph_variants(bs, lora_buffers.num_segments(bs), lora_segments, lora_seg_lens)
            for bs in self.batch_sizes}
        self.max_blocks = max_blocks_per_seq
        self.max_len = max_blocks_per_seq * kv_cache.block_size
        b = self.batch_sizes[-1]
        self.null_slot = kv_cache.null_block * kv_cache.block_size
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros((3, b) if model.mrope else (b,), dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((b,), self.null_slot, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.block_tables = torch.full((b, max_blocks_per_seq), kv_cache.null_block, dtype=torch.int32, device=device)
        self.query_start = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(b, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # no token uses an adapter
        # LoRA layers over lora_buffers, per (bucket, bound on the adapters, bound on the longest segment)
        self.lora_graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.mixture_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # both deLoRA passes over mixture_buffers
        self.pool = None

    def _context(self, bs: int, kind: str = "plain", bounds: tuple[int, int] | None = None) -> StepContext:
        lora = {"plain": None, "lora": self.lora_buffers, "mixture": self.mixture_buffers}[kind]
        static = None
        if lora is not None:
            static = lora.static_batch(bs, bounds[1], bounds[0]) if kind == "lora" else lora.static_batch(bs)
        return StepContext(slot_mapping=self.slot_mapping[:bs], query_start=self.query_start[:bs + 1],
                           context_lens=self.context_lens[:bs], block_tables=self.block_tables[:bs],
                           max_query_len=1, max_context_len=self.max_len, decode_only=True,
                           query_lens_list=[1] * bs, lora=static)

    def variants(self, bs: int) -> list[tuple[int, int]]:
        """The LoRA graphs of bucket bs as (adapters, tokens per adapter) bounds, the any-mix one last."""
        return self._variants[bs]

    def _forward(self, bs: int) -> None:
        positions = self.positions[..., :bs]
        self.hidden[:bs] = self.model(self.input_ids[:bs], positions)

    @torch.no_grad()
    def capture(self) -> None:
        """Captures every bucket, largest first so smaller graphs reuse its memory pool.

        Each warm-up runs on the stream the capture then runs on: kernels that keep state per
        stream (the handoff kernel's counters and workspace, `vlora_kernels/handoff.py`) create it
        there, outside the capture, as they must."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._capture_all(stream)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _capture_all(self, stream: torch.cuda.Stream) -> None:
        for bs in reversed(self.batch_sizes):
            variants = [("plain", None, self.graphs, bs)]
            if self.lora_buffers is not None:
                variants += [("lora", v, self.lora_graphs, (bs, *v)) for v in self.variants(bs)]
            if self.mixture_buffers is not None:
                variants.append(("mixture", None, self.mixture_graphs, bs))
            for kind, bounds, graphs, key in variants:
                with step_context(self._context(bs, kind, bounds)):
                    self._forward(bs)  # warm-up: compiles the kernels outside the capture
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        self._forward(bs)
                if self.pool is None:
                    self.pool = graph.pool()
                graphs[key] = graph

    def release(self) -> None:
        """Frees every graph and their memory pool. Graphs that captured NCCL collectives (tensor
        parallel) must go before the process group does: torch.distributed's
        destroy_process_group otherwise waits forever on the communicator they still use."""
        torch.cuda.synchronize()  # no replay still running
        for graphs in (self.graphs, self.lora_graphs, self.mixture_graphs):
            for graph in graphs.values():
                graph.reset()
            graphs.clear()
        self.pool = None

    def can_run(self, inputs: StepInputs) -> bool:
        ctx = inputs.context
        if ctx.lora is None:
            lora_ok = True
        elif isinstance(ctx.lora, MixtureBatch):
            lora_ok = self.mixture_buffers is not None and ctx.lora.op is self.mixture_buffers.op
        else:  # the operator captured, not another one (dLoRA's einsum runs eagerly)
            lora_ok = self.lora_buffers is not None and ctx.lora.op is self.lora_buffers.op
        return (ctx.decode_only and inputs.input_ids.shape[0] <= self.batch_sizes[-1]
                and ctx.block_tables.shape[1] <= self.max_blocks and inputs.mm_embeds is None and lora_ok)

    @torch.no_grad()
    def run(self, inputs: StepInputs) -> torch.Tensor:
        """hidden [B, D] of a decode batch of B sequences."""
        ctx = inputs.context
        b = inputs.input_ids.shape[0]
        bs = next(s for s in self.batch_sizes if s >= b)
        self.input_ids[:b].copy_(inputs.input_ids)
        self.positions[..., :b].copy_(inputs.positions)
        self.slot_mapping[:b].copy_(ctx.slot_mapping)
        self.slot_mapping[b:bs].fill_(self.null_slot)
        self.context_lens[:b].copy_(ctx.context_lens)
        self.context_lens[b:bs].fill_(1)
        self.block_tables[:b, :ctx.block_tables.shape[1]].copy_(ctx.block_tables)
        if isinstance(ctx.lora, MixtureBatch):  # mixture: the mixed-in slot is written too
            self.mixture_buffers.load(ctx.lora, bs)
            self.mixture_graphs[bs].replay()
        elif ctx.lora is not None:  # unmerged
            segments, longest = self.lora_buffers.load(ctx.lora.slot_ids, bs)
            self.lora_graphs[(bs, *pick_variant(segments, longest, self.variants(bs)))].replay()
        else:
            self.graphs[bs].replay()
        return self.hidden[:b]
