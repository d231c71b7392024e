"""The engine with an orchestrator policy steps through any number a request may carry, and an adapter
the policy left merged while idle unloads (tiny Qwen2-VL on CPU).

- slo_ms=5e-324 used to make V-LoRA's starving threshold 0.0: the step raised ZeroDivisionError,
  and the RPC loop started every request in flight over;
- after a request on adapter X finished, the policy kept X merged: `list_adapters` said
  `running: 1` with nothing in flight and `unload_adapter` failed ("held by 1 running sequence(s)")."""

from __future__ import annotations

import math

import pytest
from adapter_cases import one_thread  # noqa: F401 (autouse: one intra-op thread here)
from mode_cases import make_engine, setup  # noqa: F401 (module fixture: checkpoint + adapters)
from serve_cases import case_specs, make_request

from serve.orchestrator import Mode

EXTREMES = [dict(slo_ms=5e-324), dict(slo_ms=1e-300), dict(slo_ms=1e308), dict(slo_ms=math.inf),
            dict(slo_ms=5e-324, priority=1e300), dict(slo_ms=1e308, priority=5e-324),
            dict(slo_ms=1e-300, priority=1.7976931348623157e308), dict(priority=5e-324)]


def _request(spec, rid, adapter=None, max_new=4, **fields):
    r = make_request(spec, max_new, ignore_eos=True)
    r.request_id, r.adapter = rid, adapter
    for k, v in fields.items():
        setattr(r, k, v)
    return r


@pytest.mark.parametrize("policy", ["v_lora", "v_lora_paper", "dlora"])
def test_extreme_targets_and_priorities_step_without_raising(setup, policy):  # noqa: F811
    engine = make_engine(setup, max_batch_size=4, policy=policy)
    specs = case_specs("qwen2_vl")
    adapters = [None, "qv8", "all16"]
    for i, fields in enumerate(EXTREMES):
        engine.add_request(_request(specs[i % 2 + 1 if i % 3 else 1], f"x{i}", adapters[i % 3], **fields))
    # an output longer than any float can count steps of: capped at max_model_len in the policy's view
    engine.add_request(_request(specs[1], "long", "qv8", max_new=10**400))
    done, steps = {}, 0
    while len(done) < len(EXTREMES) and steps < 200:
        done.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
    engine.abort("long")
    engine.step()
    assert sorted(done) == sorted(f"x{i}" for i in range(len(EXTREMES)))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 4 for o in done.values())


def test_an_adapter_left_merged_while_idle_unloads_and_counts_no_runner(setup):  # noqa: F811
    engine = make_engine(setup, max_batch_size=4, policy="v_lora", policy_params={"max_switch_share": 1.0})
    specs = case_specs("qwen2_vl")
    for i in range(3):  # three of qv8 fill most of the batch: the policy merges it
        engine.add_request(_request(specs[i], f"q{i}", "qv8", max_new=16))
    while engine.has_unfinished():
        engine.step()
    assert engine.lora.merged == "qv8" and engine.mode == Mode.merge("qv8"), "the policy keeps it merged while idle"
    listed = {a["name"]: a for a in engine.list_adapters()}
    assert listed["qv8"]["running"] == 0 and listed["qv8"]["merged"]
    # in flight: the caller's mistake, a ValueError that names no request of anyone
    engine.add_request(_request(specs[0], "busy", "qv8"))
    with pytest.raises(ValueError, match="1 request\\(s\\) in flight") as refused:
        engine.unload_adapter("qv8")
    assert "busy" not in str(refused.value)
    while engine.has_unfinished():
        engine.step()
    engine.unload_adapter("qv8")  # at once: no idle wait, no step in between
    assert "qv8" not in {a["name"] for a in engine.list_adapters()}
    assert engine.lora.merged is None and engine.mode == Mode.unmerge()
    assert all(a["running"] == 0 for a in engine.list_adapters())
    # the engine serves on: another adapter's request runs (and may merge), the base weights are intact
    out = engine.generate(_request(specs[1], "after", "all16"))
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_unload_with_abort_folds_a_merged_adapter_out(setup):  # noqa: F811
    engine = make_engine(setup, max_batch_size=4)  # fcfs: the mode is set by hand
    specs = case_specs("qwen2_vl")
    engine.set_mode(Mode.merge("mix"))
    engine.add_request(_request(specs[0], "m0", "mix", max_new=32))
    engine.step()
    engine.unload_adapter("mix", abort=True)
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    assert engine.lora.merged is None and engine.mode == Mode.unmerge() and not engine.has_unfinished()
