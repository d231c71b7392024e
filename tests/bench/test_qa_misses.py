"""bench.qa_misses: how it groups questions and scores each group."""

from __future__ import annotations

import pytest

from bench.qa_misses import by_kind, question_kind


def test_question_kind_is_the_first_two_words_whatever_the_case_and_punctuation():
    assert question_kind("How many cars are there?") == "how many"
    assert question_kind("Is there a red bus?") == question_kind("is THERE  an owl") == "is there"
    assert question_kind("What color is the truck?") == "what color"
    assert question_kind("Why?") == "why" and question_kind("  ?") == "(empty)"


def test_by_kind_scores_each_kind_and_measures_counts_by_their_error():
    rows = [{"question": "How many cars are there?", "target": "2", "pred": "1"},
            {"question": "How many buses are there?", "target": "0", "pred": "0"},
            {"question": "How many trucks are there?", "target": "1", "pred": "3."},
            {"question": "Is there a red car?", "target": "yes", "pred": "Yes."},
            {"question": "Is there a blue car?", "target": "no", "pred": "yes"},
            {"question": "What color is the bus?", "target": "red", "pred": "black"},
            {"question": "What color is the car?", "target": "blue", "pred": "black"}]
    k = by_kind(rows)
    assert set(k) == {"how many", "is there", "what color"}
    assert k["how many"]["items"] == 3 and k["how many"]["exact"] == pytest.approx(1 / 3)
    assert k["how many"]["mean_error"] == pytest.approx((-1 + 0 + 2) / 3)
    assert k["how many"]["mean_abs_error"] == pytest.approx(1.0)
    assert k["is there"]["exact"] == 0.5 and k["is there"]["wrong"] == [("no -> yes", 1)]  # "Yes." matches "yes"
    assert k["what color"]["exact"] == 0.0 and "mean_error" not in k["what color"]
    assert k["what color"]["wrong"] == [("red -> black", 1), ("blue -> black", 1)]
    mixed = by_kind([{"question": "How many?", "target": "2", "pred": "two"}])
    assert "mean_error" not in mixed["how many"], "an answer that is not a number leaves the error out"
