"""The engine API: requests in, streamed tokens out (nano-vllm's `LLMEngine` shape).

    engine = Engine("zoo/qwen2_vl_tiny", EngineConfig(device="cpu"))
    out = engine.generate(Request(prompt="How many cars?", images=[frame]))
    for delta in engine.generate([r1, r2], stream=True): print(delta.request_id, delta.new_text)

`step()` runs one scheduler iteration and returns the progress of every request that got a
token (or was aborted, or got its head answer); the RPC server and the tests use only this class.

Adapters (serve/lora): `load_adapter(name, path)` / `unload_adapter(name)` / `list_adapters()`
while serving; `EngineConfig.adapters` / `adapter_manifest` load some at start. An adapter whose
meta.json records another base model than this checkpoint (adapters.base: by weights fingerprint)
is refused unless loaded with allow_base_mismatch=True. A request names
its adapter; `output_mode="head"` answers with the adapter's task head after one prefill
(`RequestOutput.head`, finish_reason "head"), in the same batches as generating requests.

Modes (serve/engine/planner.py): with `EngineConfig.policy` other than "fcfs", a
serve.orchestrator policy picks each step's mode (unmerge | merge(a) | mixture(a)) and batch,
planning with the cost profile of `EngineConfig.profile` (`engine.cost_profile`). With "fcfs",
`set_mode(Mode.merge("a"))` sets the mode by hand. Switches are counted and timed in `stats()`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from adapters.base import base_identity
from serve.lora.manager import AdapterManager
from serve.lora.pool import PoolConfig
from serve.models import load_model
from serve.orchestrator import POLICIES
from serve.orchestrator import CostProfile, Mode, ProfileShapes, assumed_profile, build_policy

from .anticipation import Anticipation
from .block_manager import BlockManager
from .compile_watch import WATCH
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .garbage import PAUSES
from .lookahead import upcoming_vision
from .model_runner import ModelRunner
from .planner import StepPlanner
from .preparer import Preparer
from .request import Request, RequestMetrics, RequestOutput
from .scheduler import FairShare, Scheduler, SchedulerConfig
from .sequence import MMSpan, RunState, Sequence
from .stats import EngineStats, collect_stats

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for but no CUDA device is available; use device=cpu")
    return device


def _eos_ids(path: Path, tokenizer) -> frozenset[int]:
    ids = set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    except OSError:  # no generation_config.json
        pass
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


@dataclass
class _Tracked:
    request: Request
    seq: Sequence
    detok: IncrementalDetokenizer
    metrics: RequestMetrics
    taken_in_at: tuple = (0, 0.0, 0.0)  # the engine's (num_steps, lingered_s) and PAUSES.total_s when taken in


class Engine:
    def __init__(self, checkpoint: str | Path, config: EngineConfig | None = None, weights=None):
        self.config = config = config or EngineConfig()
        self.device = resolve_device(config.device)
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.checkpoint = Path(checkpoint)
        pixels = config.pixels if config.pixels != "auto" else ("device" if self.device.type == "cuda" else "host")
        if config.quantization != "none":  # refused before the weights load (serve/models/fp8.py)
            from serve.models.fp8 import check_quantization

            check_quantization(config.quantization, self.device)
        tp = None
        if config.tensor_parallel_size > 1:  # each rank builds and reads only its shard (serve/models/parallel.py)
            from serve.models.parallel import TPGroup

            tp = TPGroup.current()
            if tp.world_size != config.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} but torch.distributed "
                                 f"has {tp.world_size} ranks")
        self.model, self.processor = load_model(checkpoint, config.dtype, self.device, backend, weights, pixels,
                                                config.quantization, tp=tp, tp_vision=config.tp_vision)
        if config.fp8_lm_head:
            from serve.models.fp8 import quantize_lm_head

            quantize_lm_head(self.model.language_model)
        self.pixels = pixels  # a front end in another process builds its Preparer the same way
        self.preparer = Preparer(self.processor, self.processor.args)  # the whole model's (a shard's are local)
        vision = self.model.vision
        tower = getattr(getattr(vision, "inner", vision), "visual", None)  # inside SplitVision under tensor parallel
        if hasattr(tower, "attention"):
            tower.attention, tower.compiled = config.vision_attention, config.vision_compile
            seconds = tower.warm_up()
            if seconds:
                log.info("vision tower kernels compiled in %.1f s", seconds)
        self.dtype = self.model.language_model.embed_tokens.weight.dtype
        if self.device.type == "cuda":
            WATCH.install()
        self.lora = None  # the pool is allocated before the K/V cache is sized from what is left
        if config.adapter_slots > 0:
            pool = PoolConfig(config.adapter_slots, config.host_adapter_cache, config.max_lora_rank,
                              config.lora_targets, config.lora_backend, config.lora_overlap_shrink,
                              tower=config.tower_lora)
            # adapters recording another base model are refused (adapters.base)
            self.lora = AdapterManager(self.model, pool, self.dtype, self.device, base_identity(self.checkpoint))
            self.lora.enable_modes(config.switch_method)  # restack weights before graphs capture them
        if config.policy not in POLICIES:
            raise ValueError(f"policy {config.policy!r} is not one of {sorted(POLICIES)}")
        self._load_startup_adapters(config)
        self.runner = ModelRunner(self.model, config, self.device, self.dtype, backend, self.lora)
        self.cost_profile: CostProfile | None = None
        policy = None
        if config.policy != "fcfs":  # fcfs: the plain scheduler, every adapter unmerged
            self.cost_profile = self._cost_profile(config)  # "measure": served-shaped steps through the runner
            policy = build_policy(config.policy, self.cost_profile, config.policy_params)
        self.block_manager = BlockManager(self.runner.kv_cache.num_blocks, config.kv_block_size,
                                          config.enable_prefix_cache)
        sched_config = SchedulerConfig(config.max_batch_size, config.max_tokens_per_step, config.chunked_prefill,
                                       self.runner.max_model_len, config.max_prefill_with_decode,
                                       decode_burst=config.decode_burst, tenant_step_cap=config.tenant_step_cap,
                                       tenant_quiet_prefill=config.tenant_quiet_prefill,
                                       tenant_quiet_rate=config.tenant_quiet_rate,
                                       tenant_seq_cap=config.tenant_seq_cap,
                                       waiting_window=config.waiting_window)
        self.scheduler = Scheduler(sched_config, self.block_manager, FairShare(), self.lora)
        self.planner = StepPlanner(policy, self.scheduler, self.lora, config.max_batch_size,
                                           config.max_tokens_per_step, self._request_info)
        tp = getattr(self.model, "tp", None)
        if tp is not None:  # ranks must take the same decisions at the same steps
            self.planner.tp = tp
            if self.lora is not None:
                self.lora.sync_swaps = True
        self.tokenizer = self.processor.tokenizer
        self.eos_token_ids = _eos_ids(self.checkpoint, self.tokenizer)
        self._requests: dict[str, _Tracked] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        # a short wait for a tenant about to send its next request (serve/engine/anticipation.py)
        self.anticipation = None if config.anticipate_ms is None else Anticipation(config.anticipate_ms,
                                                                                    time.perf_counter())
        self.step_times: deque[float] = deque(maxlen=4096)  # seconds of the model step
        self.step_log: deque[tuple[int, int, bool, float]] = deque(maxlen=65536)  # (seqs, tokens, decode-only, s)
        # beside step_log, per step: (host seconds since the previous step ended, outside the engine: the serving
        # loop's intake and replies; seconds planning the step), where a step that waits for its host shows
        self.between_log: deque[tuple[float, float]] = deque(maxlen=65536)
        self._last_step_end: float | None = None
        self.step_profiler = self.step_profiler_done = None  # serve/engine/step_profiler.py, armed by profile_steps
        self.num_steps = 0
        self.num_generated_tokens = 0
        # request ids of the last step's batch, None while a step is planning: when a step raises, only
        # these can have caused a failure past planning (the RPC loop tries them alone, serve/rpc/step_failures.py)
        self.last_batch: tuple[str, ...] | None = None
        self.warm_report = None  # serve/engine/warmup.py's report once warm_up() ran
        ahead = config.encode_ahead == "on" or (config.encode_ahead == "auto" and self.device.type == "cuda")
        self.encode_ahead = ahead and config.tensor_parallel_size == 1
        # called while a step runs on the device, before the host waits for it: a server takes in the
        # requests that arrived during the step, so that their pictures can be encoded ahead too
        self.during_step = None
        self._intake_s = 0.0  # this step's mid-step arrivals (during_step), seconds
        self.lingered_s = 0.0  # the serving loop's waits for returning tenants (lingered), all told
        PAUSES.install()  # garbage collections timed, for the requests' timing and the stats

    # ---- warm-up ----------------------------------------------------------------------------------
    @property
    def needs_warm_up(self) -> bool:
        from .warmup import wanted

        return self.warm_report is None and wanted(self.config.warm_up, self.device.type)

    def warm_up(self, **shape):
        """Runs made-up waves of requests through every shape serving meets (serve/engine/warmup.py),
        once; the caller's thread must be the only one stepping. shape: the pictures' `side`, `frames` and
        more `sizes` (default the config's warm_up_side, warm_up_frames and warm_up_sizes). Returns the WarmReport."""
        if self.warm_report is None:
            from .warmup import warm_up

            if self.has_unfinished():
                raise RuntimeError("warm_up() runs before any request is added")
            shape = {"side": self.config.warm_up_side, "frames": self.config.warm_up_frames,
                     "sizes": self.config.warm_up_sizes, **shape}
            try:
                self.warm_report = warm_up(self, **shape)
                WATCH.mark_ready()  # a Triton kernel compiled from now on is one the waves missed
            except BaseException:  # nothing made up may stay in flight to meet real requests
                self.abort_all()
                self._pending.clear()
                raise
            log.info("engine %s", self.warm_report.line())
        return self.warm_report

    # ---- modes ------------------------------------------------------------------------------------
    def _cost_profile(self, config: EngineConfig) -> CostProfile:
        if config.profile == "assumed":
            return assumed_profile()
        if config.profile == "measure":
            from .step_costs import default_shapes, measure_engine_profile

            shapes = ProfileShapes(**config.profile_shapes) if config.profile_shapes else default_shapes(self.device)
            return measure_engine_profile(self.runner, self._adapters(), shapes)
        return CostProfile.load(config.profile)

    def _request_info(self, request_id: str) -> tuple[str | None, float | None, float]:
        request = self._requests[request_id].request
        return request.app, request.slo_ms, float(request.priority)

    @property
    def mode(self) -> Mode:
        return self.planner.mode

    def set_mode(self, mode: Mode) -> None:
        """Switches the weights to `mode` now (between steps; running requests keep their tokens).
        Only without a policy (EngineConfig.policy="fcfs"): a policy sets the mode every step."""
        if self.planner.policy is not None:
            raise ValueError(f"the {self.config.policy!r} policy sets the mode every step; "
                             "set_mode needs EngineConfig.policy='fcfs'")
        if mode.merged_adapter is not None:
            self._adapters().get(mode.merged_adapter)
        if self.planner.apply(mode) != mode:
            raise ValueError(f"mode {mode} could not be applied: adapter {mode.merged_adapter!r} found no slot")

    # ---- adapters ---------------------------------------------------------------------------------
    def _adapters(self) -> AdapterManager:
        if self.lora is None:
            raise ValueError("this engine was built with adapter_slots=0 and serves the base model only")
        return self.lora

    def _load_startup_adapters(self, config: EngineConfig) -> None:
        if not (config.adapters or config.adapter_manifest or config.pinned_adapters):
            return
        if config.adapter_manifest:
            self.load_manifest(config.adapter_manifest)
        for entry in config.adapters:
            name, _, path = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
            self.load_adapter(name, path)
        for name in config.pinned_adapters:
            self.pin_adapter(name)

    def load_adapter(self, name: str, path: str | Path, pin: bool = False, allow_base_mismatch: bool = False) -> dict:
        """Reads and checks a PEFT directory (and its heads) and registers it; serving goes on.
        A bad directory, or one whose meta.json records another base model (unless
        allow_base_mismatch), raises AdapterLoadError (a ValueError) and changes nothing."""
        return self._adapters().load(name, path, pin, allow_base_mismatch)

    def load_manifest(self, path, pin: bool = False, allow_base_mismatch: bool = False) -> list[str]:
        """Loads the adapters of a fusion manifest (file or folder), an adapter directory or a list
        of these; returns their names."""
        return self._adapters().load_manifest(path, pin, allow_base_mismatch)

    def unload_adapter(self, name: str, abort: bool = False) -> None:
        """Forgets an adapter. With requests in flight on it this refuses (ValueError), unless abort=True
        aborts them. An adapter still merged into the weights with none of its requests in flight (a
        policy keeps the last merged adapter folded in while idle) is folded out first."""
        manager = self._adapters()
        manager.get(name)
        users = [rid for rid, t in self._requests.items() if t.request.adapter == name]
        if users and not abort:
            raise ValueError(f"adapter {name!r} has {len(users)} request(s) in flight; "
                             "let them finish (or abort them) before unloading it")
        for request_id in users:
            self.abort(request_id)  # each releases its sequence's reference on the adapter now
        if manager.merged == name:
            # through the planner, so its mode (what the policy sees next step) and switch stats follow
            self.planner.apply(Mode.unmerge())
            if manager.merged == name:  # merged by hand on the manager, behind the planner's back
                manager.set_merged(None)
        manager.unload(name)

    def pin_adapter(self, name: str, pinned: bool = True) -> None:
        self._adapters().pin(name, pinned)

    def list_adapters(self) -> list[dict]:
        """name, path, rank, ranks per module, targets, heads (domain -> task), residency, ... per adapter."""
        return self.lora.list() if self.lora is not None else []

    # ---- requests ---------------------------------------------------------------------------
    def prepare(self, request: Request) -> tuple:
        """The request's prompt processed (chat template, image/video preprocessing, positions).
        It reads no engine state that steps change, so it may run on any thread: the RPC server
        runs it on the client's connection thread, off the engine's. Pass it to add_request."""
        return self.preparer.prepare(request)

    def add_request(self, request: Request, prepared: tuple | None = None) -> str:
        record, head = None, None
        if request.adapter is not None:
            if self.lora is None:
                raise ValueError(f"adapter {request.adapter!r} is not loaded: this engine has adapter_slots=0 "
                                 "(base model only); send adapter=None")
            record = self.lora.get(request.adapter)
        if request.output_mode == "head":
            if record is None:
                raise ValueError("output_mode 'head' needs an adapter with a task head: name it in "
                                 "Request.adapter (and the head's domain in Request.task)")
            head = self.lora.select_head(request.adapter, request.task)
        request_id = request.request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        arrival = time.perf_counter()
        prompt, positions, delta = prepared if prepared is not None else self.prepare(request)
        if head is not None and head.config.pooling == "dense" and not prompt.vision:  # refused before any step
            raise ValueError(f"the {head.config.type} head of adapter {request.adapter!r} reads boxes off a picture's "
                             "tokens, but the request has no image or video")
        params = request.sampling
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        spans = tuple(MMSpan(v.offset, v.offset + v.num_tokens, v.content_hash) for v in prompt.vision)
        seq = Sequence(request_id, list(prompt.token_ids), params.max_tokens, stops, arrival, request.adapter, spans,
                       state=RunState(sampling=params, vision=prompt.vision, prompt_positions=positions,
                                      mrope_delta=delta, head=head),
                       adapter_version=record.version if record is not None else 0, prefill_only=head is not None,
                       owner=request.owner, tenant=request.tenant, tenant_weight=request.tenant_weight,
                       tenant_max_running=request.tenant_max_running,
                       reuse_prefix=head is None or head.config.pooling == "last")  # other poolings read every row
        self.runner.prepare_sequence(seq)
        self.scheduler.add(seq)
        metrics = RequestMetrics(arrival_time=arrival, num_prompt_tokens=seq.prompt_len)
        self._requests[request_id] = _Tracked(request, seq, IncrementalDetokenizer(self.tokenizer), metrics,
                                              (self.num_steps, self.lingered_s, PAUSES.total_s))
        if self.anticipation is not None:
            self.anticipation.taken_in(request.tenant, min(arrival, request.received or arrival))
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stops a request; its final output (finish_reason "abort") comes with the next step."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        tracked = self._requests.pop(request_id)
        self._pending.append(self._output(tracked, [], finished=True))
        if self.anticipation is not None:
            self.anticipation.gone(tracked.request.tenant, time.perf_counter(), finished=False)
        return True

    def profile_steps(self, steps: int) -> None:
        """The next `steps` steps run under torch.profiler (serve/engine/step_profiler.py); `step_profiles()` reads them."""
        from .step_profiler import StepProfiler

        self.step_profiler, self.step_profiler_done = StepProfiler(steps, self.device.type == "cuda"), None

    def step_profiles(self) -> list[dict]:
        """Each profiled step's wall ms and its top operators (so far, while steps are still to be profiled)."""
        prof = self.step_profiler or self.step_profiler_done
        return [] if prof is None else list(prof.results)

    def abort_all(self) -> int:
        """Stops every request in flight (a benchmark point's leftovers); returns how many."""
        ids = list(self._requests)
        for request_id in ids:
            self.abort(request_id)
        return len(ids)

    def drop_caches(self) -> dict[str, int]:
        """Forgets the prefix cache's free blocks and the encoder cache (running requests keep their
        blocks), so a replay of the same inputs computes everything again, as the first run did."""
        dropped = {"prefix_blocks": self.block_manager.forget_free(), "encoder_items": len(self.runner.encoder_cache)}
        self.runner.encoder_cache.clear()
        return dropped

    def release_graphs(self) -> None:
        """Frees the decode CUDA graphs; later decode steps run eagerly. A tensor-parallel rank
        calls it (through serve.distributed.leave_group) before its process group is destroyed."""
        self.runner.release_graphs()

    def num_waiting(self) -> int:
        """Requests admitted but not yet scheduled (with the tenants' backlogs)."""
        return self.scheduler.num_queued

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def linger_s(self) -> float:
        """Seconds a serving loop should wait for a tenant about to come back before the next step (0: step
        now); asked only between steps while the engine has work (serve/engine/anticipation.py)."""
        if self.anticipation is None or self._pending or not self.scheduler.has_unfinished():
            return 0.0
        return self.anticipation.wait_s(time.perf_counter())

    def lingered(self, seconds: float) -> None:
        """The serving loop waited `seconds` on linger_s's word."""
        self.anticipation.waited(seconds)
        self.lingered_s += seconds

    # ---- one iteration -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        entered = time.perf_counter()
        outputs, self._pending = self._pending, []
        orch = self.planner
        self.last_batch = None  # a failure before the batch is known (planning) may come from any request
        plan = orch.plan() if orch.policy is not None or orch.mode.kind != "unmerge" else None
        running_before = len(self.scheduler.running)
        batch = self.scheduler.schedule(plan)
        self.last_batch = tuple(seq.request_id for seq, _ in batch.entries)  # a failure from here on is theirs
        if not batch.entries:
            if self.lora is not None and self.lora.wait_pending():
                return outputs  # only adapter swaps were pending: their requests are admitted next step
            if self.scheduler.waiting and not self.scheduler.running and not batch.preempted:  # would spin
                raise RuntimeError(f"{len(self.scheduler.waiting)} waiting request(s) cannot be scheduled with "
                                   f"{self.block_manager.num_free_blocks} free K/V blocks")
            return outputs
        self._note_passed_over(batch, plan, running_before)
        start = time.perf_counter()
        for seq, _ in batch.entries:
            tracked = self._requests[seq.request_id]
            metrics = tracked.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = start
                metrics.steps_before = self.num_steps - tracked.taken_in_at[0]
                metrics.lingered_before_s = self.lingered_s - tracked.taken_in_at[1]
                metrics.gc_before_s = PAUSES.total_s - tracked.taken_in_at[2]
            else:
                metrics.plan_s += start - entered
        self._intake_s = 0.0
        cpu_start = time.thread_time()
        ahead = self._ahead(batch) if self.encode_ahead else None
        graphs = self.runner.counters["graph_steps"]
        if self.step_profiler is None:
            sampled = self.runner.run(batch, ahead)
        else:  # armed by profile_steps: this step under the profiler
            prof = self.step_profiler
            sampled = prof.run(lambda: self.runner.run(batch, ahead))
            if not prof.left:
                self.step_profiler, self.step_profiler_done = None, prof
        self.scheduler.postprocess(batch, sampled)
        now = time.perf_counter()
        graphed = self.runner.counters["graph_steps"] > graphs
        cpu = time.thread_time() - cpu_start
        phase_log = getattr(self.runner, "phase_log", None)
        phases = phase_log[-1] if phase_log else ()
        for seq, _ in batch.entries:
            tracked = self._requests[seq.request_id]
            metrics = tracked.metrics
            if not metrics.steps:
                metrics.first_step_s, metrics.first_step_tokens = now - start, batch.num_tokens
                metrics.first_phases_s, metrics.first_step_cpu_s = phases, cpu
            metrics.last_phases_s, metrics.last_step_s, metrics.last_step_cpu_s = phases, now - start, cpu
            metrics.steps += 1
            metrics.step_s += now - start
            metrics.step_tokens += batch.num_tokens
            metrics.intake_s += self._intake_s
            metrics.graph_steps += graphed
            head_done = seq.prefill_only and seq.is_finished
            if seq.seq_id not in sampled and not head_done:
                continue
            metrics.first_token_time = metrics.first_token_time or now
            if head_done:
                outputs.append(self._output(tracked, [], finished=True, head=seq.state.head_result))
            else:
                outputs.append(self._output(tracked, [sampled[seq.seq_id]], finished=seq.is_finished))
            if seq.is_finished:
                metrics.finished_time = now
                metrics.gc_s = PAUSES.total_s - tracked.taken_in_at[2]
                del self._requests[seq.request_id]
                if self.anticipation is not None:
                    self.anticipation.gone(tracked.request.tenant, now, finished=True)
        self.num_generated_tokens += len(sampled)
        self.step_times.append(now - start)
        self.step_log.append((len(batch.entries), batch.num_tokens, batch.decode_only, now - start))
        self.between_log.append((entered - (self._last_step_end or entered), start - entered))
        self._last_step_end = now if self.scheduler.has_unfinished() else None  # idle until the next arrival: no gap
        self.planner.observe_step(batch, now - start)
        self.num_steps += 1
        return outputs

    def _note_passed_over(self, batch, plan, running_before: int) -> None:
        """The first waiting request of each tenant with nothing in a step that runs another tenant's work
        counts the step against it (RequestMetrics.passed_over), and the first such step says its state."""
        sched = self.scheduler
        stepped = {seq.tenant for seq, _ in batch.entries}
        seen = set(stepped)
        seen.update(seq.tenant for seq in sched.running)
        for seq in sched.waiting:
            if seq.tenant in seen:
                continue
            seen.add(seq.tenant)
            metrics = self._requests[seq.request_id].metrics
            metrics.passed_over += 1
            if not metrics.passed_reason:
                admit = None if plan is None or plan.admit is None else plan.admit
                where = "no plan" if admit is None else \
                    (f"{admit.index(seq.request_id)} of {len(admit)}" if seq.request_id in admit else f"not of {len(admit)}")
                metrics.passed_reason = (f"admit {where}; running {running_before} -> {len(sched.running)}; "
                                         f"batch {len(batch.entries)}; free blocks {self.block_manager.num_free_blocks}; "
                                         f"preempted {len(batch.preempted)}; tenants {len(stepped)}")

    def _ahead(self, batch):
        def ahead() -> None:
            if self.during_step is not None:
                taken = time.perf_counter()
                self.during_step()
                self._intake_s += time.perf_counter() - taken
            sched = self.scheduler
            upcoming = upcoming_vision(sched, batch, self.config.max_tokens_per_step)
            if upcoming:
                ahead_now = sum(item.offset >= s.num_computed_tokens and item.content_hash in s.state.embeds
                                for queue in (sched.running, sched.waiting) for s in queue for item in s.state.vision)
                self.runner.encode_ahead(upcoming, ahead_now)
        return ahead

    def _output(self, tracked: _Tracked, new_ids: list[int], finished: bool, head=None) -> RequestOutput:
        seq, metrics = tracked.seq, tracked.metrics
        new_text = ""
        if seq.state.sampling.detokenize:
            new_text = tracked.detok.add(new_ids) if new_ids else ""
            if finished:
                new_text += tracked.detok.flush()
        metrics.num_cached_tokens = max(metrics.num_cached_tokens, seq.num_cached_tokens)
        metrics.num_preemptions = seq.num_preemptions
        logits = (seq.state.logits or None) if seq.state.sampling.keep_logits else None
        return RequestOutput(seq.request_id, new_ids, new_text, seq.output_token_ids, tracked.detok.text, finished,
                             seq.finish_reason if finished else None, metrics, tracked.request.app, logits, head)

    # ---- blocking and streaming ---------------------------------------------------------------
    def generate(self, requests: Request | list[Request], stream: bool = False):
        """Final outputs (in request order; one output for one request), or with stream=True an
        iterator of every incremental output of these requests as steps produce them."""
        single = isinstance(requests, Request)
        ids = []
        try:
            for r in [requests] if single else requests:
                ids.append(self.add_request(r))
        except Exception:
            for request_id in ids:  # all or nothing: a bad request does not leave its batch half queued
                self.abort(request_id)
            self._pending = [o for o in self._pending if o.request_id not in ids]
            raise
        if stream:
            return self._stream(ids)
        final: dict[str, RequestOutput] = {}
        for out in self._stream(ids):
            if out.finished:
                final[out.request_id] = out
        results = [final[i] for i in ids]
        return results[0] if single else results

    def _stream(self, ids: list[str]) -> Iterator[RequestOutput]:
        open_ids = set(ids)
        while open_ids:
            if not self.has_unfinished():
                raise RuntimeError(f"requests {sorted(open_ids)} vanished without a final output")
            for out in self.step():
                if out.request_id in open_ids:
                    if out.finished:
                        open_ids.discard(out.request_id)
                    yield out

    def stats(self) -> EngineStats:
        return collect_stats(self)
