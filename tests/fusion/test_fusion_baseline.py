"""Fusion accepts a domain only where its adapter beats the domain's majority baseline: a domain
no better than always answering its most common training label is rejected (no adapter, one
line saying why), and a fusion that leaves a member at its baseline rolls back. The reports show
the baseline beside each score."""

from __future__ import annotations

import json

import pytest
from fusion_fakes import ScriptedTrainer, domains

from fusion import fuse

AT_MAJORITY = {"answer": 2, "accuracy": 0.4375, "n": 32, "wins": 0, "losses": 0, "p_value": 1.0, "alpha": 0.05,
               "better": False}
BEATS = {**AT_MAJORITY, "wins": 12, "p_value": 0.0002, "better": True}


class BaselineTrainer(ScriptedTrainer):
    """A scripted trainer that also gives each evaluation's majority verdict (`Trainer.baseline`)."""

    def __init__(self, script, useless):
        super().__init__(script)
        self.useless = useless  # (members, domain) -> True where the adapter is no better than the majority

    def baseline(self, state, domain):
        return AT_MAJORITY if self.useless(frozenset(state.domains), domain.name) else BEATS


def test_a_domain_at_its_majority_baseline_is_rejected_whatever_its_requirement():
    # b scores 0.9 against a requirement of 0.8, but always answering its majority scores the same
    trainer = BaselineTrainer(lambda m, d: 0.9, lambda m, d: d == "b")
    result = fuse(domains("a", "b", "c"), trainer)
    assert [a.domains for a in result.adapters] == [["a", "c"]]
    assert [(e.action, e.domain, e.adapter) for e in result.events] == [
        ("open", "a", 0), ("rollback", "b", 0), ("reject", "b", 1), ("fuse", "c", 0)]
    assert result.events[1].violations == ("b",), "at its baseline beside a, b rolls back"
    assert result.rejected == {"b": "no better than always answering 2 (0.438, one-sided p=1)"}
    assert str(result.events[2]).startswith("step 2: reject b (b=0.900): no better than always answering 2")
    assert "rejected b: no better than always answering 2" in result.summary()
    assert result.adapters[0].baselines == {"a": BEATS, "c": BEATS}
    with pytest.raises(KeyError, match="rejected, no better than always answering 2"):
        result.adapter_of("b")


def test_a_fusion_that_leaves_a_member_at_its_baseline_rolls_back():
    # c fused beside a leaves a at its baseline (a point score still above the requirement)
    trainer = BaselineTrainer(lambda m, d: 0.9, lambda m, d: d == "a" and "c" in m)
    result = fuse(domains("a", "c"), trainer)
    assert result.events[1].action == "rollback" and result.events[1].violations == ("a",)
    assert [a.domains for a in result.adapters] == [["a"], ["c"]] and result.rejected == {}


def test_without_a_baseline_from_the_trainer_nothing_is_refused():
    result = fuse(domains("a", "b"), ScriptedTrainer(lambda m, d: 0.9))
    assert [a.domains for a in result.adapters] == [["a", "b"]] and result.rejected == {}


def test_accepting_at_baseline_keeps_the_domain_and_its_verdict_for_the_report():
    from vlora.commands.offline_report import domain_lines

    result = fuse(domains("a", "b"), BaselineTrainer(lambda m, d: 0.9, lambda m, d: d == "b"),
                  refuse_at_baseline=False)
    assert [a.domains for a in result.adapters] == [["a", "b"]] and result.rejected == {}
    assert result.adapters[0].baselines["b"] == AT_MAJORITY
    row = {"domain": "b", "task": "count", "requirement": 0.8, "fused": 0.9, "majority": "always 2 0.438",
           "beats_majority": "NO (p=1)", "fused_adapter": "fused_0", "meets_requirement": True}
    assert any(line.startswith("NO BETTER THAN MAJORITY: b fused 0.9 against always 2 0.438 (NO (p=1))")
               for line in domain_lines({"domains": [row]}))


def test_a_rejection_is_journaled_and_a_journal_made_without_the_check_is_not_resumed_under_it(tmp_path):
    work = tmp_path / "work"
    first = fuse(domains("a", "b", "c"), BaselineTrainer(lambda m, d: 0.9, lambda m, d: d == "b"), workdir=work)
    again = BaselineTrainer(lambda m, d: 0.9, lambda m, d: d == "b")
    resumed = fuse(domains("a", "b", "c"), again, workdir=work)
    assert again.train_calls == 0 and resumed.rejected == first.rejected
    assert resumed.adapters[0].baselines == first.adapters[0].baselines
    journal = json.loads((work / "journal.json").read_text())
    journal.pop("baseline_check")  # as written before fusion checked baselines
    (work / "journal.json").write_text(json.dumps(journal))
    with pytest.raises(ValueError, match="baseline_check"):
        fuse(domains("a", "b", "c"), BaselineTrainer(lambda m, d: 0.9, lambda m, d: d == "b"), workdir=work)


def test_the_fusion_report_shows_the_baseline_beside_each_score_and_one_line_per_rejection(capsys):
    from vlora.commands.demo_report import missed_lines
    from vlora.commands.fusion import print_event, result_lines
    from vlora.commands.offline_report import domain_lines, rejected_row

    result = fuse(domains("a", "b", "c"), BaselineTrainer(lambda m, d: 0.9, lambda m, d: d == "b"),
                  progress=print_event)
    err = capsys.readouterr().err.splitlines()
    assert err[2] == ("[fusion step 2] reject      b: b 0.90, no better than always answering 2 (0.438, "
                      "one-sided p=1): no adapter serves it")
    assert "b no better than always answering 2" in err[1], "the roll-back says why too"
    text = "\n".join(result_lines(result))
    assert "a 0.90 (>= 0.80; always 2 0.438)" in text
    assert "REJECTED: b, no better than always answering 2 (0.438, one-sided p=1): no adapter serves it" in text
    row = rejected_row({"domain": "b", "task": "count", "requirement": 0.8}, result.events[2], 32)
    lines = "\n".join(domain_lines({"domains": [row], "not_measured": {"fused": "fusion rejected the domain"}}))
    lines = lines.splitlines()
    assert any(line.startswith("REJECTED: b 0.900 alone, no better than always answering 2") for line in lines)
    assert not any(line.startswith("Every domain meets") for line in lines)
    table = next(line for line in lines if line.startswith("b "))
    assert "always 2 0.438" in table and "NO (p=1)" in table
    assert missed_lines({"domains": [row]}) == [
        "Missed requirement: b rejected by fusion, 0.900 alone, no better than always answering 2 (0.438, one-sided p=1)"]
