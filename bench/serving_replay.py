"""Real-time replay of a workload trace against the engine (the serving evaluation's inner loop).

`build_requests` turns each RequestView of a trace into an engine Request of the same shape:
`frames` random images (frames = the prompt tokens beyond the typical question, over the tokens
of one frame) plus as many words as the rest of the prompt, asking exactly `output_tokens`
tokens. `replay` submits each request once the wall clock passes its arrival time, steps the
engine while it has work, and measures each request from its scheduled arrival (so time spent
waiting for a running step to end counts, as it would for a client). Like the RPC server, it
preprocesses requests (chat template, images) on threads of their own, off the thread that
steps the engine, when the engine offers `prepare`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.engine import WORDS
from bench.results import write_json
from serve.engine import Request, SamplingParams
from serve.orchestrator import Mode, RequestRecord, RequestView, adapter_names, build_policy, summarize


LEARNING_COLUMNS = ("pred_err_median", "plan_err_median", "learned_steps", "guard_engaged", "guard_fallback_steps",
                    "guard_to_merge", "guard_to_unmerge", "slowest_step_ms", "slowest_step_pred_ms",
                    "slowest_step_mode", "kernel_compiles", "host_us_per_step", "step_ms_mean")


def use_policy(engine, name: str, params: dict) -> None:
    """Puts policy `name` (fresh state) in charge of the engine, the weights unmerged."""
    engine.planner.apply(Mode.unmerge())
    # the planner points the engine's operators at the policy's (dLoRA: einsum, per-layer switches)
    engine.planner.policy = None if name == "fcfs" else build_policy(name, engine.cost_profile, params)
    engine.config.policy = name


def build_requests(trace: Sequence[RequestView], names: Sequence[str], image_size: int, seed: int,
                   text_tokens: int = 32, max_frames: int = 16) -> list[Request]:
    """Engine requests for a trace. names: the served adapters that the workload's adapter-000,
    adapter-001, ... stand for (other adapter names pass through unchanged)."""
    serve_name = dict(zip(adapter_names(len(names)), names))
    tokens_per_frame = max(1, (image_size // 28) ** 2)  # Qwen2-VL: 14-pixel patches merged 2x2
    out = []
    for i, r in enumerate(trace):
        rng = np.random.default_rng([seed, i])  # distinct images and words: no prefix or encoder-cache reuse
        frames = min(max_frames, max(1, round((r.prompt_tokens - text_tokens) / tokens_per_frame)))
        words = max(1, r.prompt_tokens - frames * tokens_per_frame)
        images = list(rng.integers(0, 256, (frames, image_size, image_size, 3), dtype=np.uint8))
        head = r.output_mode == "head"  # one prefill answered by the adapter's (only) task head
        params = SamplingParams(max_tokens=1 if head else r.output_tokens, ignore_eos=True, detokenize=False)
        out.append(Request(prompt=" ".join(rng.choice(WORDS, words)), images=images, sampling=params,
                           adapter=serve_name.get(r.adapter, r.adapter), app=r.app, slo_ms=r.slo_ms,
                           priority=r.priority, request_id=r.request_id, output_mode=r.output_mode))
    return out


def replay(engine, trace: Sequence[RequestView], requests: Sequence[Request], drain_s: float,
           prepare_threads: int = 4, records_out: dict | None = None,
           log_path: Path | None = None) -> tuple[dict, dict]:
    """Serves the trace in real time. Returns (Metrics.as_row() of the run, extra columns: aborted
    requests, steps per mode kind, replay seconds). Requests unfinished `drain_s` after the last
    arrival are aborted and count as not completed. The engine's prefix and encoder caches are
    emptied first: every policy replays the same images and prompts, and none may find the K/V or
    vision embeddings of the run before it. (Engine replicas behind Ray cannot be reached to empty
    theirs: replays against them must carry inputs of their own.) prepare_threads: threads that
    run engine.prepare for arriving requests, as the RPC server's connections do (0: add_request
    preprocesses on the stepping thread); an engine without `prepare` (replicas, which preprocess
    on their side) is given the raw requests. records_out: filled with each request's
    RequestRecord (its times from the replay's start), for callers that need more than the summary.
    log_path: where a policy that keeps a decision log writes it, with its learning and guard reports,
    as JSON (a replay far off its peers is read by its switches, fallbacks and slowest steps)."""
    if hasattr(engine, "drop_caches"):
        engine.drop_caches()
    before = engine.stats()
    records = records_out if records_out is not None else {}
    records.update({r.request_id: RequestRecord(r.request_id, r.app, r.adapter, r.arrival_ms, r.prompt_tokens,
                                           r.output_tokens, r.slo_ms) for r in trace})
    prepare = getattr(engine, "prepare", None) if prepare_threads > 0 else None
    pool = ThreadPoolExecutor(prepare_threads, thread_name_prefix="prepare") if prepare is not None else None
    preparing: deque = deque()  # (request index, future of its preprocessing), in arrival order
    start = time.perf_counter()
    arrivals = [start + r.arrival_ms / 1e3 for r in trace]
    deadline = (arrivals[-1] if arrivals else start) + drain_s
    open_ids: set[str] = set()
    i, aborted = 0, 0
    try:
        while i < len(trace) or open_ids or preparing:
            now = time.perf_counter()
            while i < len(trace) and arrivals[i] <= now:
                if pool is None:
                    open_ids.add(engine.add_request(requests[i]))
                else:
                    preparing.append((i, pool.submit(prepare, requests[i])))
                i += 1
            while preparing and preparing[0][1].done():
                k, future = preparing.popleft()
                open_ids.add(engine.add_request(requests[k], future.result()))
            if now > deadline:
                aborted += len(preparing)  # never reached the engine: not completed
                for request_id in sorted(open_ids):
                    aborted += engine.abort(request_id)
                while engine.has_unfinished():  # hands the abort outputs over
                    engine.step()
                break
            if not open_ids:
                if preparing:
                    time.sleep(0.0005)
                else:
                    time.sleep(max(0.0, arrivals[i] - time.perf_counter()))
                continue
            for o in engine.step():
                if not o.finished:
                    continue
                open_ids.discard(o.request_id)
                rec, m = records[o.request_id], o.metrics
                rec.prompt_tokens, rec.output_tokens = m.num_prompt_tokens, max(1, len(o.token_ids))
                rec.first_scheduled_ms = (m.first_scheduled_time - start) * 1e3
                rec.first_token_ms = (m.first_token_time - start) * 1e3
                rec.finish_ms = (m.finished_time - start) * 1e3
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    replay_s = time.perf_counter() - start
    after = engine.stats()
    steps = {k: (after.steps_by_mode or {}).get(k, 0) - (before.steps_by_mode or {}).get(k, 0)
             for k in ("unmerge", "merge", "mixture")}
    metrics = summarize(records.values(), switches=after.mode_switches - before.mode_switches,
                        switch_ms=after.switch_ms_total - before.switch_ms_total)
    extra = {"aborted": aborted, **{f"steps_{k}": v for k, v in steps.items()}, "replay_s": replay_s,
             **learning_columns(getattr(after, "policy_stats", None)),
             "kernel_compiles": _compiled(after) - _compiled(before), "step_ms_mean": _step_ms(engine, after, before)}
    policy = getattr(getattr(engine, "planner", None), "policy", None)
    if log_path is not None and (getattr(after, "policy_stats", None) or {}).get("learning") is not None:
        write_json(log_path, {"policy": policy.name, "stats": after.policy_stats, "start_ms": start * 1e3,
                              "decisions": [dataclasses.asdict(d) for d in policy.log if _telling(d)]})
    return metrics.as_row(), extra


def _telling(d) -> bool:
    """A decision worth keeping: a switch, a guard's fallback, or a step far slower than predicted."""
    slow = d.measured_ms is not None and d.predicted_ms is not None and d.measured_ms > 1.5 * d.predicted_ms + 5
    return d.switch or d.reason.startswith("guard") or slow


def _step_ms(engine, after, before) -> float:
    """The replay's mean measured step (the model step, without the planner's host time around it); nan
    for engines that count no steps of their own (replicas: each replica steps its own engine)."""
    if not hasattr(after, "num_steps"):
        return float("nan")
    n = after.num_steps - before.num_steps
    times = list(getattr(engine, "step_times", ()))[-n:] if 0 < n <= 4096 else []
    return 1e3 * sum(times) / len(times) if times else float("nan")


def _compiled(stats) -> int:
    """Triton kernel variants compiled in this process so far (0 where none are watched)."""
    k = getattr(stats, "kernel_compiles", None) or {}
    return k.get("before_ready", 0) + k.get("after_ready", 0)


def learning_columns(policy_stats: dict | None) -> dict:
    """What a learning policy reports of its replay (one policy object per replay): the median
    |predicted - measured| / measured of its steps (predicted before each was learnt from) and of
    its decisions' planned steps, the steps learnt from, and how often and how long its guard fell
    back to a fixed mode. nan / 0 for a policy that does not learn."""
    learning = (policy_stats or {}).get("learning") or {}
    guard = (policy_stats or {}).get("guard") or {}
    slowest = (learning.get("slowest") or [{}])[0]
    host_steps = (policy_stats or {}).get("host_steps") or 0

    def num(value):
        return float("nan") if value is None else value

    return {"pred_err_median": num(learning.get("median_abs_rel_err")),
            "plan_err_median": num(learning.get("plan_median_abs_rel_err")),
            "learned_steps": learning.get("observed", 0), "guard_engaged": guard.get("engaged", 0),
            "guard_fallback_steps": guard.get("fallback_steps", 0),
            "guard_to_merge": (guard.get("engaged_to") or {}).get("merge", 0),
            "guard_to_unmerge": (guard.get("engaged_to") or {}).get("unmerge", 0),
            "slowest_step_ms": num(slowest.get("measured_ms")), "slowest_step_pred_ms": num(slowest.get("predicted_ms")),
            "slowest_step_mode": slowest.get("mode", ""),
            # the planner's host time per step (plan + observe), in series with the GPU: any policy's
            "host_us_per_step": 1e3 * policy_stats["host_ms"] / host_steps if host_steps else float("nan")}
