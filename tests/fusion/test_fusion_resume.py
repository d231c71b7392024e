"""Resumable fusion: an interrupted run continues from its journal and ends as an unbroken one."""

from __future__ import annotations

import json

import pytest
from fusion_fakes import FIG10, Interrupted, ScriptedTrainer, domains, fig10_script

from fusion import JOURNAL, Domain, fuse

# (domains, script): the figure 10 case, and one whose journal holds a parked (rolled-back)
# adapter and its joined state while its violator is tried alone, then a domain fused though it
# misses (place_missed="best").
SCENARIOS = {
    "fig10": (FIG10, fig10_script),
    "missed": (domains("a", "x", "b", "c"), lambda m, d: 0.3 if d == "x" else 0.9),
}


def snapshot(result):
    return ([(a.index, a.name, a.domains, a.accuracies, a.requirements, a.met, a.state) for a in result.adapters],
            result.events, result.order)


def reference(name):
    ds, script = SCENARIOS[name]
    trainer = ScriptedTrainer(script)
    return snapshot(fuse(ds, trainer)), trainer.train_calls


@pytest.mark.parametrize("name, calls", [("fig10", 7), ("missed", 5)])
def test_interrupt_at_every_train_call_then_resume(tmp_path, name, calls):
    expected, total = reference(name)
    assert total == calls
    ds, script = SCENARIOS[name]
    for k in range(1, calls + 1):
        work = tmp_path / f"k{k}"
        with pytest.raises(Interrupted):
            fuse(ds, ScriptedTrainer(script, fail_on_train=k), workdir=work)
        healthy, seen = ScriptedTrainer(script), []
        result = fuse(ds, healthy, workdir=work, progress=seen.append)
        assert snapshot(result) == expected, f"interrupted at train call {k}"
        assert healthy.train_calls == calls - (k - 1), "finished steps were trained again"
        assert [e.step for e in seen] == list(range(k - 1, calls))  # only the new steps are reported


def test_workdir_holds_journal_and_closed_adapters_only(tmp_path):
    trainer = ScriptedTrainer(fig10_script)
    result = fuse(FIG10, trainer, workdir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_0", "adapter_1", JOURNAL]
    for a in result.adapters:
        assert a.path == str(tmp_path / f"adapter_{a.index}")
        assert trainer.load(a.path) == a.state
    journal = json.loads((tmp_path / JOURNAL).read_text())
    assert journal["done"] and journal["order"] == "size_desc" and len(journal["events"]) == 7


def test_open_adapter_checkpoint_is_replaced_step_by_step(tmp_path):
    with pytest.raises(Interrupted):
        fuse(FIG10, ScriptedTrainer(fig10_script, fail_on_train=3), workdir=tmp_path)
    ckpts = sorted(p.name for p in tmp_path.glob("ckpt_*"))
    assert ckpts == ["ckpt_2"]  # after steps 0 and 1, only the latest good state is kept
    assert json.loads((tmp_path / "ckpt_2").read_text())["domains"] == ["plate", "sign"]


def test_finished_journal_returns_without_training(tmp_path):
    first = fuse(FIG10, ScriptedTrainer(fig10_script), workdir=tmp_path)
    again = ScriptedTrainer(fig10_script)
    assert snapshot(fuse(FIG10, again, workdir=tmp_path)) == snapshot(first)
    assert again.train_calls == 0 and again.save_calls == 0


@pytest.mark.parametrize("fail_on_save", [1, 2, 3, 4, 5])
def test_crash_while_saving_a_checkpoint(tmp_path, fail_on_save):
    expected, _ = reference("fig10")
    with pytest.raises(Interrupted):
        fuse(FIG10, ScriptedTrainer(fig10_script, fail_on_save=fail_on_save), workdir=tmp_path)
    assert snapshot(fuse(FIG10, ScriptedTrainer(fig10_script), workdir=tmp_path)) == expected


def interrupted(tmp_path, ds=FIG10, **kwargs):
    with pytest.raises(Interrupted):
        fuse(ds, ScriptedTrainer(fig10_script, fail_on_train=4), workdir=tmp_path, **kwargs)


def test_resume_with_other_domains_is_refused(tmp_path):
    interrupted(tmp_path)
    with pytest.raises(ValueError, match=r"other domains: in the journal only \['person'\], given only \[\]"):
        fuse(FIG10[:-1], ScriptedTrainer(fig10_script), workdir=tmp_path)
    stricter = [Domain("plate", "detect", 0.9, 600), *FIG10[1:]]
    with pytest.raises(ValueError, match="domains changed.*plate"):
        fuse(stricter, ScriptedTrainer(fig10_script), workdir=tmp_path)


def test_resume_with_another_order_is_refused(tmp_path):
    interrupted(tmp_path)
    with pytest.raises(ValueError, match="order='size_desc', now order='given'"):
        fuse(FIG10, ScriptedTrainer(fig10_script), order="given", workdir=tmp_path)


def test_resume_with_another_seed_or_given_order_is_refused(tmp_path):
    interrupted(tmp_path / "s", order="seeded", seed=1)
    with pytest.raises(ValueError, match="seed=1, now seed=2"):
        fuse(FIG10, ScriptedTrainer(fig10_script), order="seeded", seed=2, workdir=tmp_path / "s")
    interrupted(tmp_path / "g", order="given")
    with pytest.raises(ValueError, match="domain order differs"):
        fuse(FIG10[::-1], ScriptedTrainer(fig10_script), order="given", workdir=tmp_path / "g")


def test_resume_with_another_placement_of_missed_domains_is_refused(tmp_path):
    interrupted(tmp_path)
    with pytest.raises(ValueError, match="place_missed='best', now place_missed='alone'"):
        fuse(FIG10, ScriptedTrainer(fig10_script), workdir=tmp_path, place_missed="alone")


def test_resume_under_other_trainer_settings_is_refused(tmp_path):
    """States trained without rehearsal must not be continued by a trainer that rehearses."""
    interrupted(tmp_path)
    rehearsing = ScriptedTrainer(fig10_script)
    rehearsing.settings = {"rehearsal": 1.0, "refit_epochs": 3}
    with pytest.raises(ValueError, match=r"trainer=\{\}, now trainer=\{'rehearsal': 1.0"):
        fuse(FIG10, rehearsing, workdir=tmp_path)


def test_missing_checkpoint_is_reported(tmp_path):
    interrupted(tmp_path)
    for p in tmp_path.glob("ckpt_*"):
        p.unlink()
    with pytest.raises(FileNotFoundError, match="ckpt_3.*missing"):
        fuse(FIG10, ScriptedTrainer(fig10_script), workdir=tmp_path)


def test_corrupt_journal_is_reported(tmp_path):
    (tmp_path / JOURNAL).write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        fuse(FIG10, ScriptedTrainer(fig10_script), workdir=tmp_path)
