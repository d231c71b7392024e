"""Greedy accuracy-aware fusion: packing, roll-back, flagged domains, orders and bad input."""

from __future__ import annotations

import pytest
from fusion_fakes import FIG10, FakeState, ScriptedTrainer, domains, fig10_script

from fusion import Domain, fuse, order_domains


def packing(result):
    return [a.domains for a in result.adapters]


def actions(result):
    return [(e.step, e.action, e.domain, e.adapter) for e in result.events]


def test_figure_10_rolls_back_at_vegetation():
    trainer = ScriptedTrainer(fig10_script)
    result = fuse(FIG10, trainer)
    assert packing(result) == [["plate", "sign", "car"], ["vegetation", "bicycle", "person"]]
    assert [a.name for a in result.adapters] == ["fused_0", "fused_1"]
    assert actions(result) == [
        (0, "open", "plate", 0), (1, "fuse", "sign", 0), (2, "fuse", "car", 0),
        (3, "rollback", "vegetation", 0), (4, "open", "vegetation", 1),
        (5, "fuse", "bicycle", 1), (6, "fuse", "person", 1)]
    rollback = result.events[3]
    assert rollback.violations == ("plate", "sign")
    assert rollback.accuracies == {"plate": 0.74, "sign": 0.79, "car": 0.9, "vegetation": 0.9}
    # Adapter 0 keeps the accuracies of its pre-vegetation state, all above requirement.
    assert result.adapters[0].accuracies == {"plate": 0.9, "sign": 0.9, "car": 0.9}
    assert result.adapters[0].requirements == {"plate": 0.8, "sign": 0.85, "car": 0.7}
    assert result.num_adapters == 2 and result.all_met and result.unmet == []
    assert trainer.train_calls == len(result.events) == 7


def test_rollback_restores_previous_state_and_never_trains_the_rejected_one():
    trainer = ScriptedTrainer(fig10_script)
    result = fuse(FIG10, trainer)
    rejected = FakeState(0, ("plate", "sign", "car", "vegetation"))
    assert trainer.returned[3] == rejected
    assert rejected not in trainer.trained_from
    # The closed adapter is the very state returned before vegetation was trained in.
    assert result.adapters[0].state is trainer.returned[2]
    assert result.adapters[0].state == FakeState(0, ("plate", "sign", "car"))
    assert trainer.trained_from[4] == FakeState(1)  # vegetation restarts on a fresh adapter
    assert result.adapters[1].state == FakeState(1, ("vegetation", "bicycle", "person"))


def test_everything_fits_in_one_adapter():
    result = fuse(domains("a", "b", "c", "d"), ScriptedTrainer(lambda m, d: 0.95))
    assert packing(result) == [["a", "b", "c", "d"]]
    assert [e.action for e in result.events] == ["open", "fuse", "fuse", "fuse"]
    assert result.events[-1].accuracies == {"a": 0.95, "b": 0.95, "c": 0.95, "d": 0.95}


def test_nothing_shares_gives_one_adapter_per_domain():
    trainer = ScriptedTrainer(lambda m, d: 0.9 if len(m) == 1 else 0.5)
    result = fuse(domains("a", "b", "c"), trainer)
    assert packing(result) == [["a"], ["b"], ["c"]]
    assert [e.action for e in result.events] == ["open", "rollback", "open", "rollback", "open"]
    assert result.all_met and trainer.train_calls == 5


def test_capacity_limit_packs_greedily():
    result = fuse(domains(*"abcdefg"), ScriptedTrainer(lambda m, d: 0.9 if len(m) <= 3 else 0.1))
    assert packing(result) == [["a", "b", "c"], ["d", "e", "f"], ["g"]]


def test_violation_on_an_earlier_domain_alone_triggers_rollback():
    # Fusing b leaves b itself fine but pushes a below its requirement.
    trainer = ScriptedTrainer(lambda m, d: 0.6 if (d == "a" and "b" in m) else 0.9)
    result = fuse(domains("a", "b", "c"), trainer)
    assert result.events[1].action == "rollback" and result.events[1].violations == ("a",)
    assert result.events[1].accuracies["b"] == 0.9
    assert packing(result) == [["a"], ["b", "c"]]


def test_violation_on_the_new_domain_triggers_rollback():
    trainer = ScriptedTrainer(lambda m, d: 0.6 if (d == "b" and "a" in m) else 0.9)
    result = fuse(domains("a", "b", "c"), trainer)
    assert result.events[1].violations == ("b",)
    assert packing(result) == [["a"], ["b", "c"]]


def test_domain_failing_alone_is_kept_flagged_and_its_rollback_adapter_reopens():
    """The paper's placement (place_missed="alone"): a domain that misses alone too keeps an adapter of its own."""
    trainer = ScriptedTrainer(lambda m, d: 0.3 if d == "x" else 0.9)
    result = fuse(domains("a", "x", "b"), trainer, place_missed="alone")
    assert actions(result) == [(0, "open", "a", 0), (1, "rollback", "x", 0), (2, "alone_fails", "x", 1),
                               (3, "fuse", "b", 0)]
    assert packing(result) == [["a", "b"], ["x"]]
    flagged = result.adapters[1]
    assert not flagged.met and flagged.accuracies == {"x": 0.3} and flagged.unmet == ["x"]
    assert result.adapters[0].met and not result.all_met and result.unmet == ["x"]
    assert result.events[2].violations == ("x",)


@pytest.mark.parametrize("names, expect", [
    (("x", "a", "b"), [["x"], ["a", "b"]]),  # first domain fails: nothing to reopen
    (("a", "b", "x"), [["a", "b"], ["x"]]),  # last domain fails: a/b close at the end
    (("x", "y"), [["x"], ["y"]]),
])
def test_failing_alone_at_the_ends(names, expect):
    result = fuse(domains(*names), ScriptedTrainer(lambda m, d: 0.3 if d in "xy" else 0.9), place_missed="alone")
    assert packing(result) == expect
    assert sorted(result.unmet) == sorted(n for n in names if n in "xy")


def test_a_domain_missing_alone_too_stays_where_it_scored_no_lower():
    """place_missed="best" (the default): x misses 0.8 alone (0.3) and beside a (0.3, the only
    one below there), so the joined state is kept: no adapter of x's own, no index skipped."""
    trainer = ScriptedTrainer(lambda m, d: 0.3 if d == "x" else 0.9)
    result = fuse(domains("a", "x", "b"), trainer)
    assert actions(result) == [(0, "open", "a", 0), (1, "rollback", "x", 0), (2, "fuse_missed", "x", 0),
                               (3, "fuse", "b", 0)]
    assert packing(result) == [["a", "x", "b"]] and result.adapters[0].index == 0
    only = result.adapters[0]
    assert not only.met and only.unmet == ["x"] and result.unmet == ["x"] and not result.all_met
    assert result.events[2].accuracies == {"x": 0.3} and result.events[2].violations == ("x",)
    assert trainer.trained_from[3] == FakeState(0, ("a", "x")), "b trains on top of the joined state"


@pytest.mark.parametrize("script, why", [
    (lambda m, d: {"x": 0.5 if m == {"x"} else 0.4}.get(d, 0.9), "x scores lower beside a than alone"),
    (lambda m, d: 0.3 if d == "x" else (0.7 if "x" in m else 0.9), "x also pushed a below its requirement"),
])
def test_a_domain_missing_alone_keeps_its_own_adapter_where_joining_was_worse(script, why):
    result = fuse(domains("a", "x", "b"), ScriptedTrainer(script))
    assert [e.action for e in result.events] == ["open", "rollback", "alone_fails", "fuse"], why
    assert packing(result) == [["a", "b"], ["x"]]


def test_a_fused_missing_domain_keeps_its_accuracy_alone_as_its_floor():
    """x (0.5 alone, 0.55 beside a) is fused; b would drop it to 0.45, below what x gets alone,
    so b rolls back as if x had a requirement of 0.5; c leaves x at 0.55 and joins."""
    def script(members, d):
        if d != "x":
            return 0.9
        return 0.5 if members == {"x"} else (0.45 if "b" in members else 0.55)

    result = fuse(domains("a", "x", "b", "c"), ScriptedTrainer(script))
    assert [(e.action, e.domain, e.violations) for e in result.events] == [
        ("open", "a", ()), ("rollback", "x", ("x",)), ("fuse_missed", "x", ("x",)), ("rollback", "b", ("x",)),
        ("open", "b", ()), ("fuse", "c", ())]
    assert packing(result) == [["a", "x"], ["b", "c"]]


def test_requirement_boundary_is_inclusive():
    result = fuse(domains("a", "b", requirement=0.8), ScriptedTrainer(lambda m, d: 0.8))
    assert packing(result) == [["a", "b"]]


def test_size_desc_order_breaks_ties_by_name():
    ds = [Domain("b", "count", 0.5, 10), Domain("c", "count", 0.5, 30), Domain("a", "count", 0.5, 10)]
    assert [d.name for d in order_domains(ds, "size_desc")] == ["c", "a", "b"]
    assert [d.name for d in order_domains(ds, "given")] == ["b", "c", "a"]
    result = fuse(ds, ScriptedTrainer(lambda m, d: 0.9))
    assert [d.name for d in result.order] == ["c", "a", "b"]
    assert result.adapters[0].domains == ["c", "a", "b"]


def test_given_order_changes_the_packing():
    trainer = ScriptedTrainer(fig10_script)
    result = fuse(list(reversed(FIG10)), trainer, order="given")
    assert packing(result) == [["person", "bicycle", "vegetation", "car"], ["sign", "plate"]]


def test_seeded_order_is_deterministic_and_depends_on_the_seed_only():
    ds = domains(*"abcdefgh")
    names = lambda seed, src=ds: [d.name for d in order_domains(src, "seeded", seed)]  # noqa: E731
    assert names(3) == names(3) == names(3, list(reversed(ds)))
    assert len({tuple(names(s)) for s in range(6)}) > 1
    assert sorted(names(1)) == list("abcdefgh")
    run = lambda seed: fuse(ds, ScriptedTrainer(lambda m, d: 0.9), order="seeded", seed=seed)  # noqa: E731
    assert [e.domain for e in run(5).events] == names(5) == [e.domain for e in run(5).events]


def test_progress_callback_sees_every_event():
    seen = []
    result = fuse(FIG10, ScriptedTrainer(fig10_script), progress=seen.append)
    assert seen == result.events
    assert "rollback vegetation -> adapter 0" in str(seen[3]) and "plate, sign" in str(seen[3])
    assert "fused_1" in result.summary()


@pytest.mark.parametrize("kwargs, match", [
    ({"requirement": 1.5}, "requirement"), ({"requirement": -0.1}, "requirement"),
    ({"requirement": True}, "requirement"), ({"size": -1}, "size"), ({"name": ""}, "name"),
    ({"task": ""}, "task"),
])
def test_domain_validation(kwargs, match):
    args = {"name": "a", "task": "count", "requirement": 0.5, "size": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        Domain(**args)


def test_bad_fuse_inputs_say_what_is_wrong():
    ok = ScriptedTrainer(lambda m, d: 0.9)
    with pytest.raises(ValueError, match="repeated: \\['a'\\]"):
        fuse(domains("a", "b") + domains("a"), ok)
    with pytest.raises(ValueError, match="order must be one of"):
        fuse(domains("a"), ok, order="random")
    with pytest.raises(ValueError, match="no domains"):
        fuse([], ok)
    with pytest.raises(TypeError, match="fusion.Domain"):
        fuse(["a"], ok)
    with pytest.raises(ValueError, match="evaluate returned 85 for domain 'a'"):
        fuse(domains("a"), ScriptedTrainer(lambda m, d: 85))

    class NoIO:
        new_adapter, train, evaluate = ok.new_adapter, ok.train, ok.evaluate

    assert fuse(domains("a"), NoIO()).num_adapters == 1  # save/load only matter with a workdir
    with pytest.raises(TypeError, match="lacks \\['save', 'load'\\]"):
        fuse(domains("a"), NoIO(), workdir="unused")
