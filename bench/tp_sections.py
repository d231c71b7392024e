"""The tensor-parallel benchmark's sections, in the order of their worth (bench/tp.py): TP=1 (parity
outputs, timings), each TP=N (parity against TP=1, timings), then the float32 reference. Every
measured row goes to `save` at once; a row already in `rows` (a resumed run) is not measured again."""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch

from serve.engine import Engine, EngineConfig

from .engine import _prompts, _run_engine
from .tp_parity import parity_rows, run_sequence
from .tp_rank import Ranks


REFERENCE_MIN_S = 60  # a float32 7B engine's load and parity runs, about


def _key(row: dict) -> tuple:
    mode = row.get("tp_vision")
    if mode is None and row["section"] == "vision":  # rows from before both modes were timed: split on a group
        mode = "whole" if row["tp"] == 1 else "split"
    return row["section"], row["tp"], row.get("batch"), mode


def vision_modes(tp: int) -> tuple[str, ...]:
    """How the tower runs at each size: the whole tower on one GPU; on a group split and whole
    (EngineConfig.tp_vision), the split one profiled."""
    return ("whole",) if tp == 1 else ("split", "whole")


def run_sections(job, clock, rows, meta, save, ckpt: str, adapters: dict, kv_blocks: int, log) -> None:
    from .tp import _free

    done = {_key(r) for r in rows}
    names = list(adapters)
    parity_left = [n for n in job.sizes if ("parity", n, None, None) not in done]
    noise_left = job.fp32_reference and ("noise", 1, None, None) not in done
    outputs: dict[int, dict] = {}

    for tp in (1, *job.sizes):
        if clock.left() <= 0:
            meta["notes"].append(f"TP={tp} skipped: past budget_s={job.budget_s:g}")
            log(meta["notes"][-1])
            continue
        want_outputs = bool(parity_left or noise_left) if tp == 1 else (tp in parity_left or noise_left)
        if not want_outputs and _timings_done(job, done, tp):
            continue
        try:
            _one_size(job, clock, tp, want_outputs, parity_left, outputs, done, save, meta, ckpt, adapters,
                      kv_blocks, log)
        except Exception as e:  # this size's rows so far are saved; the next size and the reference still run
            import traceback

            traceback.print_exc()
            meta["notes"].append(f"TP={tp} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            log(meta["notes"][-1])
            save([])
        _free(job.device)
    if noise_left:
        _reference(job, clock, ckpt, adapters, kv_blocks, outputs, names, save, meta, log)


def _one_size(job, clock, tp: int, want_outputs: bool, parity_left: list, outputs: dict, done: set, save, meta,
              ckpt: str, adapters: dict, kv_blocks: int, log) -> None:
    """Builds TP=tp (one engine, or a group), runs its parity sequence when wanted and its timings."""
    from .tp import engine_config

    log(f"TP={tp}: building {'the engine' if tp == 1 else 'the group'}")
    t0 = time.monotonic()
    config = engine_config(job, adapters, kv_blocks, tp, job.dtype)
    ranks = (Ranks.single(Engine(ckpt, EngineConfig.from_dict(config))) if tp == 1
             else Ranks.group_of(ckpt, config, job.threads))  # a group that fails to start stops its ranks
    meta["seconds"][f"build_tp{tp}"] = time.monotonic() - t0
    log(f"TP={tp}: built in {time.monotonic() - t0:.0f} s")
    try:
        if want_outputs:
            log(f"TP={tp}: parity runs")
            t0 = time.monotonic()
            outputs[tp] = _parity_outputs(ranks, job, list(adapters), log)
            meta["seconds"][f"parity_tp{tp}"] = time.monotonic() - t0
            if tp != 1 and tp in parity_left and 1 in outputs:
                save(parity_rows(outputs[1], outputs[tp], "parity", tp, "TP=1", job.dtype))
                log(f"TP={tp}: parity saved")
        t0 = time.monotonic()
        _timings(job, clock, ranks, tp, done, save, meta, log)
        meta["seconds"][f"timing_tp{tp}"] = time.monotonic() - t0
    except BaseException:
        ranks.abort()  # a follower may be waiting in a collective rank 0 will never join
        raise
    ranks.close()


def _parity_outputs(ranks: Ranks, job, names: list[str], log) -> dict:
    # in a function of its own: no name outlives it holding the engine (its GPU memory) after close
    with ranks.serving() as engine:
        return run_sequence(engine, job, names, log)


def _timings_done(job, done: set, tp: int) -> bool:
    keys = [("decode", tp, b, None) for b in job.batches] + [("prefill", tp, None, None)]
    keys += [("vision", tp, None, m) for m in vision_modes(tp)]
    if job.profile:
        keys.append(("vision_profile", tp, None, vision_modes(tp)[0]))
    if job.profile and job.device.startswith("cuda"):
        keys += [("profile", tp, b, None) for b in job.batches]
    return all(k in done for k in keys)


def _timings(job, clock, ranks: Ranks, tp: int, done: set, save, meta, log) -> None:
    """Decode steps per batch, prefill, the vision encoder and the profiled steps of one TP size."""
    end = time.monotonic() + min(job.section_s, max(clock.left(), 0.0))

    def past(what: str) -> bool:
        if time.monotonic() < end:
            return False
        meta["notes"].append(f"TP={tp} {what} skipped: past section_s={job.section_s:g} or budget_s")
        log(meta["notes"][-1])
        return True

    for b in job.batches:
        if ("decode", tp, b, None) in done:
            continue
        if past(f"decode batch {b}"):
            return
        step_ms = ranks.call("replay", job, b)
        with ranks.serving() as engine:
            run = _run_engine(engine, SimpleNamespace(output_tokens=job.decode_tokens),
                              _prompts(job, engine.tokenizer, b, 1000 * b))
        save([dict(section="decode", tp=tp, batch=b, decode_step_ms=step_ms, decode_context=job.decode_context,
                   decode_wall_ms=run["decode_wall_ms"], decode_steps=run["decode_steps"])])
        log(f"TP={tp} decode b={b}: step {step_ms:.3f} ms (graph replay + LM head), wall {run['decode_wall_ms']:.3f} ms")
    if ("prefill", tp, None, None) not in done and not past("prefill"):
        with ranks.serving() as engine:
            prompts = _prompts(job, engine.tokenizer, job.prompts, 2000)
            one = SimpleNamespace(output_tokens=1)
            _run_engine(engine, one, prompts)  # first shapes out of the timing
            runs = [_run_engine(engine, one, prompts) for _ in range(3)]
        ms = statistics.median(r["total_s"] for r in runs) * 1e3
        save([dict(section="prefill", tp=tp, prompts=job.prompts, prompt_tokens=sum(runs[0]["prompt_lens"]),
                   prefill_ms=ms)])
        log(f"TP={tp} prefill of {job.prompts} prompts with images: {ms:.1f} ms")
    _vision(job, ranks, tp, done, save, meta, log, past)
    if not (job.profile and job.device.startswith("cuda")):
        note = "communication share: NCCL kernels are counted on a GPU only (profile=true, device=cuda)"
        if note not in meta["notes"]:
            meta["notes"].append(note)
        return
    for b in job.batches:
        if ("profile", tp, b, None) in done or past(f"profile batch {b}"):
            continue
        got = ranks.call("profile", job, b)
        if "error" in got:  # every rank made its calls all the same
            meta["notes"].append(f"TP={tp} profile b={b}: {got['error']}")
            log(meta["notes"][-1])
            continue
        save([dict(section="profile", tp=tp, batch=b, **got)])
        log(f"TP={tp} profile b={b}: NCCL {got.get('comm_share', float('nan')):.1%} of the step")


def _vision(job, ranks: Ranks, tp: int, done: set, save, meta, log, past) -> None:
    """The encoder timed in each of `vision_modes(tp)`, then (profile=true) one call of the first
    profiled on rank 0."""
    for mode in vision_modes(tp):
        if ("vision", tp, None, mode) in done or past(f"vision {mode}"):
            continue
        got = ranks.call("vision", job, job.vision_images, mode)
        save([dict(section="vision", tp=tp, images=job.vision_images, **got)])
        parts = (f"; rank 0 tower {got['tower_ms']:.1f}, gather {got['gather_ms']:.1f}, host {got['host_ms']:.1f} ms, "
                 f"slowest peer tower {got['peer_tower_ms']:.1f}, host {got['peer_host_ms']:.1f} ms"
                 if "tower_ms" in got else "")
        log(f"TP={tp} vision encoder {mode}, {got['items']} items ({got['items_here']} on rank 0): "
            f"{got['vision_ms']:.1f} ms{parts}")
    mode = vision_modes(tp)[0]
    if not job.profile or ("vision_profile", tp, None, mode) in done or past("vision profile"):
        return
    got = ranks.call("vision_profile", job, job.vision_images)
    if "error" in got:
        meta["notes"].append(f"TP={tp} vision profile: {got['error']}")
        log(meta["notes"][-1])
        return
    save([dict(section="vision_profile", tp=tp, images=job.vision_images, **got)])
    log(f"TP={tp} vision {mode}, profiled on rank 0: span {got['span_us'] / 1e3:.1f} ms, tower "
        f"{got['tower_us'] / 1e3:.1f}, all-gather {got['comm_us'] / 1e3:.1f}, idle {got['idle_us'] / 1e3:.1f}")


def _reference(job, clock, ckpt, adapters, kv_blocks, outputs, names, save, meta, log) -> None:
    """A float32 TP=1 engine's parity sequence; every bf16 run held here compared with it."""
    from .tp import _free, engine_config

    if clock.left() < REFERENCE_MIN_S:
        meta["notes"].append(f"fp32 reference skipped: {max(clock.left(), 0):.0f} s of budget_s={job.budget_s:g} left "
                             f"(it needs ~{REFERENCE_MIN_S} s at the 7B shape)")
        log(meta["notes"][-1])
        return
    if not outputs:
        meta["notes"].append("fp32 reference skipped: no bf16 outputs in this run (a resumed run)")
        return
    log("fp32 TP=1 reference: building")
    t0 = time.monotonic()
    engine = None
    try:
        engine = Engine(ckpt, EngineConfig.from_dict(engine_config(job, adapters, kv_blocks, 1, "float32")))
        ref = run_sequence(engine, job, names, log)
    except Exception as e:  # out of GPU memory, say: what was measured stays, with the reason
        what = "out of GPU memory" if isinstance(e, torch.cuda.OutOfMemoryError) else type(e).__name__
        meta["notes"].append(f"fp32 reference skipped: {what} ({str(e).splitlines()[0] if str(e) else ''})")
        log(meta["notes"][-1])
        save([])
        return
    finally:
        if engine is not None:
            engine.release_graphs()
        del engine
        _free(job.device)
    meta["seconds"]["fp32_reference"] = time.monotonic() - t0
    new = []
    for tp, got in sorted(outputs.items()):
        new += parity_rows(ref, got, "noise", tp, "fp32 TP=1", job.dtype)
    save(new)
    log("fp32 reference: noise rows saved")
