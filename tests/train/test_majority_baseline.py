"""The majority baseline: an adapter that always answers the most common training label is
flagged "no better than always answering X", by a paired test rather than a point comparison;
`vlora train` prints the baseline beside the score and records it in the adapter's meta.json."""

from __future__ import annotations

import json

import pytest

from train.baselines import (baseline_cell, baseline_line, beats_cell, compare_to_majority, majority,
                             sign_test_p)

# training counts: "2" is the most common label (as on the recording whose count adapter said 2 on every chunk)
TRAIN_COUNTS = [2] * 40 + [1] * 25 + [3] * 20 + [4] * 15
EVAL_COUNTS = [2] * 14 + [1] * 9 + [3] * 6 + [4] * 3  # 32 items; always 2 scores 14/32 = 0.4375


def test_the_majority_is_the_most_common_training_label_and_ties_do_not_depend_on_row_order():
    assert majority(TRAIN_COUNTS) == 2
    assert majority(["b", "a", "b", "a"]) == majority(["a", "b", "a", "b"]) == "a"
    with pytest.raises(ValueError, match="training labels"):
        majority([])


def test_the_sign_test_is_exact_and_one_sided():
    assert sign_test_p(0, 0) == 1.0, "nothing tells the two apart"
    assert sign_test_p(5, 0) == 1 / 32
    assert sign_test_p(2, 0) == 0.25
    assert sign_test_p(0, 5) == 1.0
    assert sign_test_p(8, 2) == pytest.approx(56 / 1024)  # P(X >= 8), X ~ Bin(10, 1/2): not below 0.05


def test_a_constant_answer_adapter_is_flagged():
    verdict = compare_to_majority("count", [2] * len(EVAL_COUNTS), EVAL_COUNTS, TRAIN_COUNTS)
    assert verdict["answer"] == 2 and verdict["accuracy"] == 0.4375 and verdict["n"] == 32
    assert (verdict["wins"], verdict["losses"], verdict["p_value"], verdict["better"]) == (0, 0, 1.0, False)
    # a constant answer other than the majority is no better either
    assert compare_to_majority("count", [1] * 32, EVAL_COUNTS, TRAIN_COUNTS)["better"] is False
    metrics = {"metric": "top1", "accuracy": 0.4375, "baseline": verdict}
    line = baseline_line("count_people", metrics)
    assert line.startswith("NO BETTER THAN MAJORITY: count_people top1 0.438")
    assert "always answering 2 (0.438 on 32 eval items" in line and "p=1" in line
    assert baseline_cell(verdict) == "always 2 0.438" and beats_cell(verdict) == "NO (p=1)"


def test_a_clearly_better_adapter_is_not_flagged():
    preds = list(EVAL_COUNTS)
    preds[14] = preds[15] = 2  # wrong on two non-majority items, right on the other 30
    verdict = compare_to_majority("count", preds, EVAL_COUNTS, TRAIN_COUNTS)
    assert verdict["wins"] == 16 and verdict["losses"] == 0 and verdict["better"] is True
    assert baseline_line("count_people", {"metric": "top1", "accuracy": 30 / 32, "baseline": verdict}) == ""
    assert beats_cell(verdict).startswith("yes (p=")


def test_a_few_items_never_show_an_adapter_better_nor_does_a_point_lead():
    small = compare_to_majority("binary", ["yes", "yes", "no", "no"], ["yes", "yes", "no", "no"], ["no"] * 5)
    assert small["accuracy"] == 0.5 and small["wins"] == 2 and small["better"] is False, "4 items, every one right"
    targets = ["no"] * 22 + ["yes"] * 28  # always "no" is right on 22 of 50
    train = ["no"] * 9 + ["yes"]
    # right on the 22 and on 3 more: 0.50 against 0.44, a point lead that chance gives 1 time in 8
    close = ["no"] * 25 + ["no"] * 25
    close[22:25] = ["yes"] * 3
    assert compare_to_majority("binary", close, targets, train)["better"] is False
    # right on 17 of the 22 and on 20 of the others: 0.74, 20 wins against 5 losses
    ahead = ["no"] * 17 + ["yes"] * 5 + ["yes"] * 20 + ["no"] * 8
    verdict = compare_to_majority("binary", ahead, targets, train)
    assert (verdict["wins"], verdict["losses"], verdict["better"]) == (20, 5, True)


def test_generated_answers_compare_as_the_exact_match_metric_does():
    verdict = compare_to_majority("lm", ["Yes.", "yes", "no"], ["yes", "Yes", "no"], ["yes", "yes", "no"])
    assert verdict["answer"] == "yes" and verdict["accuracy"] == pytest.approx(2 / 3)
    assert (verdict["wins"], verdict["losses"]) == (1, 0)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="detect.*no majority baseline"):
        compare_to_majority("detect", [[]], [[]], [[]])
    with pytest.raises(ValueError, match="paired predictions and targets, got 2 and 1"):
        compare_to_majority("count", [1, 2], [1], [1])


def _all_no(vlora_home, tiny_zoo, tmp_path):
    """exists_bus with every label "no": no adapter can answer better than always "no"."""
    import shutil

    from datasets import load_from_disk
    from train_fixtures import tiny_domain

    src = tiny_domain(vlora_home, "exists_bus", tiny_zoo["qwen2_vl_tiny"], limit=12)
    splits = load_from_disk(str(src)).map(lambda r: {"label": "no", "answer": "no"})
    out = tmp_path / "datasets" / "exists_bus"
    splits.save_to_disk(str(out))
    shutil.copy(src / "domain.json", out / "domain.json")
    return out


def test_vlora_train_prints_the_baseline_and_flags_an_uninformative_adapter(tiny_zoo, vlora_home, tmp_path, capsys):
    from vlora.commands import train as train_command
    from vlora.config import compose

    path = _all_no(vlora_home, tiny_zoo, tmp_path)
    cfg = compose("train", ["train.base=model", "train.allow_random_base=true", f"train.dataset_dir={path}",
                            f"train.out_dir={tmp_path / 'bus'}", "train.epochs=1", "train.batch_size=4",
                            "adapter.rank=4"])
    out = train_command.run(cfg)
    verdict = out["metrics"]["exists_bus"]["baseline"]
    assert verdict["answer"] == "no" and verdict["accuracy"] == 1.0 and verdict["better"] is False
    printed = capsys.readouterr().out
    assert "always 'no' 1.000" in printed and "NO (p=1)" in printed
    assert "NO BETTER THAN MAJORITY: exists_bus top1" in printed and "no better than always answering 'no'" in printed
    meta = json.loads((tmp_path / "bus" / "meta.json").read_text())
    assert meta["domains"]["exists_bus"]["baseline"] == verdict, "the saved metrics carry the baseline"
    from train import load_adapter

    assert load_adapter(tmp_path / "bus").accuracies["exists_bus"]["baseline"] == verdict


def test_fusion_rejects_a_real_adapter_no_better_than_its_majority(tiny_zoo, vlora_home, tmp_path):
    import os

    from fusion import Domain, fuse
    from train import LoraSpec, LoraTrainer, ModelRef, TrainConfig, VisionLM

    path = _all_no(vlora_home, tiny_zoo, tmp_path)
    vlm = VisionLM(ModelRef("qwen2_vl_tiny", str(tiny_zoo["qwen2_vl_tiny"])), LoraSpec(rank=4, alpha=8), device="cpu")
    trainer = LoraTrainer(vlm, path.parent, TrainConfig(epochs=1, batch_size=4), log=open(os.devnull, "w"))
    # a requirement the adapter meets (it answers "no" like every label), and still no knowledge
    result = fuse([Domain("exists_bus", "binary", 0.5, 9)], trainer)
    assert [e.action for e in result.events] == ["reject"] and result.adapters == []
    assert result.rejected["exists_bus"].startswith("no better than always answering 'no' (1.000")
