"""Garbage collections: every pause is timed, by generation, and charged to the requests it held."""

from __future__ import annotations

import gc

from serve.engine import Engine, EngineConfig, Request, SamplingParams
from serve.engine.garbage import PAUSES


def test_every_collection_is_timed_by_generation():
    PAUSES.install()
    PAUSES.install()  # once only
    assert gc.callbacks.count(PAUSES) == 1
    before, total = PAUSES.stats(), PAUSES.total_s
    garbage = []
    garbage.append(garbage)  # a cycle only a collection frees
    del garbage
    assert gc.collect() >= 1
    after = PAUSES.stats()
    assert after["gen2"]["count"] == before["gen2"]["count"] + 1
    assert after["gen2"]["ms"] > before["gen2"]["ms"] and PAUSES.total_s > total
    assert after["gen2"]["max_ms"] >= after["gen2"]["ms"] - before["gen2"]["ms"] - 1e-3


# ---- a real engine ------------------------------------------------------------------------------------

def _request(rid: str, tokens: int) -> Request:
    return Request(prompt=f"Count to {tokens}, {rid}.", sampling=SamplingParams(max_tokens=tokens, ignore_eos=True),
                   request_id=rid)


def test_a_request_is_charged_the_collections_that_held_it(tiny_zoo):
    engine = Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(device="cpu", num_kv_blocks=128, policy="fcfs"))
    engine.encode_ahead = True  # as on a GPU: arrivals are taken in while a step runs
    arrivals = iter([_request("late", 2)])

    def mid_step() -> None:
        for r in arrivals:
            engine.add_request(r)
            gc.collect()  # a full collection between its arrival and its first step

    engine.during_step = mid_step
    engine.add_request(_request("early", 3))
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    late, early = final["late"].metrics, final["early"].metrics
    assert late.gc_before_s > 0 and late.gc_s >= late.gc_before_s
    assert early.gc_before_s == 0  # its first step came before the collection
    assert early.gc_s >= late.gc_before_s  # it was running meanwhile

