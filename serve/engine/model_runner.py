"""The only part of the engine that touches the model and the device.

Owns the model, the K/V cache, the encoder cache, the decode CUDA graphs and the sampling
generators. `run(batch)` builds the step's inputs and its adapter metadata (one LoraBatch for
all layers, from the adapter manager's slots), encodes the images the step needs, runs the
forward (graph replay for decode-only steps on GPU, eager otherwise), computes logits for
the sequences that reached their last token and samples their next tokens. Head-mode
sequences collect their prompt's final hidden states over their prefill chunks instead and,
at their last chunk, get their task head's answer in `seq.state.head_result`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from contextlib import nullcontext

import torch

from heads import prompt_token_xy
from serve.models import VisionLanguageModel
from serve.models.vision import token_cells

from .config import EngineConfig
from serve.forward.context import StepContext, step_context
from .cuda_graph import DecodeGraphs
from .encoder_cache import EncoderCache, tower_key
from .inputs import StepInputs, attach_vision, build_step_inputs, release_vision
from .kv_cache import KVCache, blocks_for_gpu_budget, bytes_per_block
from .request import STEP_PHASES
from .sampling import sample
from .scheduler import ScheduledBatch
from .sequence import Sequence

CPU_DEFAULT_BLOCKS = 512


class ModelRunner:
    def __init__(self, model: VisionLanguageModel, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 backend: str, lora=None):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.lora = lora  # serve.lora.AdapterManager, or None (base model only)
        args = model.args
        self.block_size = config.kv_block_size
        block_bytes = bytes_per_block(args.num_layers, self.block_size, args.num_kv_heads, args.head_dim, dtype)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif device.type == "cuda":
            self._profile_peak()
            num_blocks = blocks_for_gpu_budget(device, config.gpu_memory_fraction, block_bytes)
        else:
            num_blocks = CPU_DEFAULT_BLOCKS
        tp = getattr(model, "tp", None)
        if tp is not None and tp.world_size > 1:  # every rank schedules alike: one cache size for all
            num_blocks = tp.agreed_min(num_blocks, device)
        self.kv_cache = KVCache(args.num_layers, num_blocks, self.block_size, args.num_kv_heads, args.head_dim,
                                dtype, device)
        self.kv_cache.bind(model.language_model.attention_layers())
        self.max_model_len = min(config.max_model_len or args.max_position_embeddings, num_blocks * self.block_size)
        self.encoder_cache = EncoderCache(config.encoder_cache_items)
        self.counters = {"encoder_calls": 0, "items_encoded": 0, "items_encoded_ahead": 0, "encode_ahead_failures": 0,
                         "graph_steps": 0, "eager_steps": 0}
        self._ahead_failed: set[str] = set()  # items whose encode ahead failed: left to their own step
        # per run(), the host's seconds in each phase (PHASES): where a slow step's time went, the device's
        # work (wait) or the host's own (a step whose host phases are long left the device idle meanwhile)
        self.phase_log: deque[tuple[float, ...]] = deque(maxlen=65536)
        self.default_generator = torch.Generator(device=device).manual_seed(config.seed)
        self.graphs = None
        if device.type == "cuda" and config.cuda_graphs and backend == "triton":
            max_blocks = -(-self.max_model_len // self.block_size)
            top = max(config.graph_batch_sizes)
            lora_buffers = lora.graph_buffers(top) if lora is not None else None
            mixture_buffers = lora.mixture_graph_buffers(top) if lora is not None else None
            self.graphs = DecodeGraphs(model, self.kv_cache, config.graph_batch_sizes, max_blocks,
                                       args.hidden_size, dtype, device, lora_buffers, mixture_buffers,
                                       config.lora_graph_segments, config.lora_graph_seg_lens)
            self.graphs.capture()

    def release_graphs(self) -> None:
        """Drops the decode CUDA graphs (decode then runs eagerly)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    @torch.no_grad()
    def _profile_peak(self) -> None:
        """A forward over a full token budget without a cache, so the activation peak is measured."""
        n = min(self.config.max_tokens_per_step, self.model.args.max_position_embeddings)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        positions = torch.arange(n, device=self.device)
        if self.model.mrope:
            positions = positions.expand(3, -1).contiguous()
        torch.cuda.reset_peak_memory_stats(self.device)
        ctx = StepContext(None, None, None, None, n, n, False, query_lens_list=[n], context_lens_list=[n])
        with step_context(ctx):
            hidden = self.model(ids, positions)
            self.model.compute_logits(hidden[-self.config.max_batch_size:])
        del hidden
        torch.cuda.synchronize(self.device)

    def prepare_sequence(self, seq: Sequence) -> None:
        """Per-sequence device state at admission: the sampling generator."""
        seed = seq.state.sampling.seed
        if seed is not None:
            seq.state.generator = torch.Generator(device=self.device).manual_seed(seed)
        if seq.state.vision and self._adapts_tower(seq.adapter):  # its tower outputs are its adapter's own
            seq.state.vision = [dataclasses.replace(it, content_hash=tower_key(it.content_hash, seq.adapter,
                                                                               seq.adapter_version))
                                for it in seq.state.vision]

    def _adapts_tower(self, adapter: str | None) -> bool:
        return adapter is not None and self.lora is not None and self.lora.tower is not None \
            and self.lora.adapts_tower(adapter)

    def _tower_step(self, entries: list[tuple[Sequence, int]]):
        """The step's encoder calls apply each tower-adapting request's adapter to its items."""
        slots = {it.content_hash: self.lora.slot_of(seq.adapter) for seq, _ in entries
                 if seq.state.vision and self._adapts_tower(seq.adapter) for it in seq.state.vision}
        return self.lora.tower.step(slots) if slots else nullcontext()

    @torch.no_grad()
    def run(self, batch: ScheduledBatch, ahead=None) -> dict[int, int]:
        """Runs one step; returns seq_id -> sampled token for sequences that reached their last token.
        `ahead()`, if given, runs once the step's work is queued on the device and before the host
        waits for its results: the engine encodes the next step's pictures there (encode_ahead), so
        the device has work while the host plans the next step."""
        entries = batch.entries
        marks = [time.perf_counter()]
        inputs = build_step_inputs(self.model, entries, self.block_size, self.device)
        if self.lora is not None:
            inputs.context.lora = self.lora.step_batch([(seq.adapter, n) for seq, n in entries])
        marks.append(time.perf_counter())
        with self._tower_step(entries):
            attach_vision(self.model, inputs, entries, self.encoder_cache, self.config.max_vision_batch, self.counters)
        marks.append(time.perf_counter())
        hidden = self._forward(inputs)
        release_vision(entries)
        marks.append(time.perf_counter())
        heads = self._launch_heads(entries, hidden)
        keep = [i for i, seq in enumerate(inputs.sample_seqs) if not seq.prefill_only]
        seqs = [inputs.sample_seqs[i] for i in keep]
        tokens = logits = ready = None
        if keep:
            rows = torch.tensor([inputs.sample_rows[i] for i in keep])
            rows = (rows.pin_memory() if self.device.type == "cuda" else rows).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden[rows]).float()  # [N, V]
            tokens = sample(logits, [s.state.sampling for s in seqs], [s.state.generator for s in seqs],
                            self.default_generator)
            if tokens.is_cuda:
                tokens = tokens.to("cpu", non_blocking=True)  # pinned, queued
                ready = torch.cuda.Event()
                ready.record()
        marks.append(time.perf_counter())
        if ahead is not None:
            ahead()
        marks.append(time.perf_counter())
        if heads is not None:
            done, pending = heads
            for seq, result in zip(done, pending.results()):
                seq.state.head_rows, seq.state.head_result = None, result
        if ready is not None:
            ready.synchronize()
        marks.append(time.perf_counter())
        self.phase_log.append(tuple(b - a for a, b in zip(marks, marks[1:])))
        if not keep:
            return {}
        for i, seq in enumerate(seqs):
            if seq.state.sampling.keep_logits:
                seq.state.logits.append(logits[i].cpu())
        return {seq.seq_id: token for seq, token in zip(seqs, tokens.tolist())}

    # run()'s host phases, in order (vision: decode, patchify, the tower's launches; wait: heads, sampled tokens)
    PHASES = STEP_PHASES

    def encode_ahead(self, upcoming: list, ahead_now: int) -> int:
        """Encodes pictures of the next step's (seq, item) pairs behind the work already queued; returns
        how many. Each sequence holds its own until its prefill passes them (the encoder cache, which may
        push them out, gets them too, for other requests with the same pixels). `ahead_now`: items the
        sequences hold that their prefill has not reached; at most the cache's capacity are, so a guess
        that runs ahead of the steps cannot hold memory without bound. Items of tower-adapting requests are left to their
        own step (their encoder call needs that step's adapter slots), as are those the cache has."""
        cache, failed = self.encoder_cache, self._ahead_failed
        todo, seen = [], {}
        for seq, item in upcoming:
            key = item.content_hash
            if key in failed or key in seq.state.embeds or self._adapts_tower(seq.adapter):
                continue
            cached = cache.get(key) if key in cache else None
            if cached is not None:
                seq.state.embeds[key] = cached
            elif key in seen:
                seen[key].append(seq)
            else:
                seen[key] = [seq]
                todo.append(item)
        todo = todo[:max(0, cache.capacity - ahead_now)]
        done = 0
        for i in range(0, len(todo), self.config.max_vision_batch):
            chunk = todo[i:i + self.config.max_vision_batch]
            try:
                embeds = self.model.encode(chunk)
            except Exception:  # a bad picture fails at its own step, charged to its own request, not here
                if len(failed) > 4096:
                    failed.clear()
                failed.update(item.content_hash for item in chunk)
                self.counters["encode_ahead_failures"] += 1
                continue
            for item, emb in zip(chunk, embeds):
                cache.put(item.content_hash, emb)
                for seq in seen[item.content_hash]:
                    seq.state.embeds[item.content_hash] = emb
            done += len(chunk)
            self.counters["encoder_calls"] += 1
            self.counters["items_encoded"] += len(chunk)
            self.counters["items_encoded_ahead"] += len(chunk)
        return done

    def _launch_heads(self, entries: list[tuple[Sequence, int]], hidden: torch.Tensor):
        """Head-mode sequences keep their rows of this step; at its last chunk a sequence's head is queued.
        Returns (sequences, PendingHeads) for the step's finished prompts, or None."""
        row, done = 0, []
        for seq, n in entries:
            if seq.prefill_only:
                start = seq.num_computed_tokens  # before this step (postprocess advances it)
                if start == seq.num_cached_tokens or seq.state.head_rows is None:  # first chunk (again, if preempted)
                    seq.state.head_rows = []
                seq.state.head_rows.append(hidden[row:row + n].clone())  # a graph's output buffer is reused
                if start + n == seq.num_tokens:
                    done.append(seq)
            row += n
        if not done:
            return None
        from serve.lora.heads import launch_heads  # every head answer of the step in one batch per head

        merge = self.model.args.spatial_merge_size
        jobs = [(seq.state.head, torch.cat(seq.state.head_rows),
                 self._token_xy(seq, merge) if seq.state.head.config.pooling == "dense" else None) for seq in done]
        return done, launch_heads(jobs)

    @staticmethod
    def _token_xy(seq: Sequence, merge: int) -> torch.Tensor:
        """[prompt, 2] cell centres of the prompt's visual tokens, host-built (a dense head's request
        without pictures is refused at admission)."""
        return prompt_token_xy(seq.prompt_len, [(item.offset, token_cells(item, merge)) for item in seq.state.vision])

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(inputs):
            self.counters["graph_steps"] += 1
            return self.graphs.run(inputs)
        self.counters["eager_steps"] += 1
        with step_context(inputs.context):
            return self.model(inputs.input_ids, inputs.positions, inputs.mm_embeds, inputs.mm_mask)
