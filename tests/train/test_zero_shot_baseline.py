"""The zero-shot baseline: the base model, its adapter switched off, answers the eval items through
its LM head; the texts are read as the apps read served answers, cached per base and eval split,
and an adapter is compared with them item by item by the sign test of the majority baseline."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from train import LoraSpec, ModelRef, VisionLM, load_domain
from train.data import DomainInfo
from train.zero_shot import ZeroShot, base_answers, compare_to_zero_shot


def _info(task, labels=None):
    return DomainInfo("d", task, labels=labels)


def test_generated_text_is_read_as_the_apps_read_served_answers():
    from vlora.commands.train import served_answer

    assert served_answer(_info("count"), "There are three cars.") == 3
    assert served_answer(_info("count"), "none") == 0 and served_answer(_info("count"), "cars") is None
    assert served_answer(_info("binary"), "Yes, there is.") == "yes" and served_answer(_info("binary"), "bus") is None
    assert served_answer(_info("classify", ["red", "blue"]), "It is Blue.") == "blue"
    assert served_answer(_info("detect"), "car at (0.1, 0.2, 0.5, 0.6)") == [[0.1, 0.2, 0.5, 0.6]]
    assert served_answer(_info("detect"), "car at (10, 20, 50, 60)") == [[0.1, 0.2, 0.5, 0.6]], "percent boxes"
    assert served_answer(_info("lm"), "A red car.") == "A red car." and served_answer(_info("lm"), " ") is None


def _record(answers, targets, task="count"):
    from train.baselines import item_scores

    return {"n": len(answers), "answers": answers, "targets": targets, "read": [a is not None for a in answers],
            "scores": item_scores(task, answers, targets),
            "accuracy": sum(item_scores(task, answers, targets)) / len(targets)}


def test_the_verdict_is_a_paired_sign_test_on_the_same_items():
    targets = [1, 2, 3, 4] * 5
    base = [1, 2, None, None] * 5  # right on half, 10 answers unreadable
    same = compare_to_zero_shot("count", base, targets, _record(base, targets))
    assert (same["accuracy"], same["unparsed"], same["wins"], same["losses"], same["better"]) == (0.5, 10, 0, 0, False)
    ahead = compare_to_zero_shot("count", targets, targets, _record(base, targets))
    assert (ahead["wins"], ahead["losses"], ahead["better"]) == (10, 0, True)
    # a point lead (right on 12 of 20 against 10) is no evidence
    lead = compare_to_zero_shot("count", [1, 2, 3, 4] + [1, 2, 0, 0] * 4, targets, _record(base, targets))
    assert (lead["wins"], lead["losses"], lead["better"]) == (2, 0, False)
    # an evaluation of the first items only: the base's score on those
    assert compare_to_zero_shot("count", targets[:4], targets[:4], _record(base, targets))["accuracy"] == 0.5
    with pytest.raises(ValueError, match="paired targets"):
        compare_to_zero_shot("count", targets * 2, targets * 2, _record(base, targets))


def test_detect_compares_each_item_s_f1():
    box = [0.1, 0.1, 0.5, 0.5]
    targets = [[box]] * 8
    base = [[]] * 8  # finds nothing: F1 0 on every item
    verdict = compare_to_zero_shot("detect", [[box]] * 8, targets, _record(base, targets, "detect"))
    assert (verdict["wins"], verdict["losses"], verdict["better"]) == (8, 0, True)


@pytest.fixture(scope="module")
def vlm(tiny_zoo):
    return VisionLM(ModelRef("qwen2_vl_tiny", str(tiny_zoo["qwen2_vl_tiny"])), LoraSpec(rank=4, alpha=8), device="cpu")


def test_the_base_answers_whatever_lora_is_loaded_and_is_cached_beside_the_dataset(vlm, tiny_zoo, vlora_home, tmp_path,
                                                                                   monkeypatch):
    from train_fixtures import tiny_domain

    from vlora.commands.train import served_answer

    src = tiny_domain(vlora_home, "count_vehicles", tiny_zoo["qwen2_vl_tiny"], limit=12)
    shutil.copytree(src, tmp_path / "count_vehicles")
    data = load_domain(tmp_path / "count_vehicles")
    vlm.reset_lora(0)  # B = 0: the model answers as its base
    expected = base_answers(vlm, data, 4)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in vlm.lora_parameters():
            p.normal_(0.0, 0.5)  # a LoRA that changes the answers
    lora = vlm.lora_state()
    record = ZeroShot(served_answer, max_new_tokens=4).record(vlm, data)
    assert record["texts"] == expected and record["n"] == data.size("eval")
    assert all(torch.equal(v, lora[k]) for k, v in vlm.lora_state().items()), "the adapter keeps its weights"
    cached = list((data.path / "zero_shot").glob("*.json"))
    assert len(cached) == 1 and json.loads(cached[0].read_text())["texts"] == expected

    def generate(*args, **kwargs):
        raise AssertionError("the cached answers were generated again")

    monkeypatch.setattr("train.zero_shot.base_answers", generate)
    again = ZeroShot(served_answer, max_new_tokens=4).record(vlm, load_domain(data.path))
    assert again == record, "another process reads the cache"
    with pytest.raises(AssertionError, match="generated again"):  # another decoding length is another baseline
        ZeroShot(served_answer, max_new_tokens=5).record(vlm, data)
    cached[0].write_text("{damaged")  # an interrupted write: generated again, not a crash
    with pytest.raises(AssertionError, match="generated again"):
        ZeroShot(served_answer, max_new_tokens=4).record(vlm, data)


def _learned_nothing(vlora_home, tiny_zoo, root):
    """The qa domain with every answer "no", for an adapter that takes no step: it answers exactly as
    its base does, so it is no better than the base zero-shot, and no better than always "no"."""
    from datasets import load_from_disk
    from train_fixtures import tiny_domain

    src = tiny_domain(vlora_home, "qa", tiny_zoo["qwen2_vl_tiny"], limit=12)
    out = root / "qa"
    load_from_disk(str(src)).map(lambda r: {"label": "no", "answer": "no"}).save_to_disk(str(out))
    shutil.copy(src / "domain.json", out / "domain.json")
    return out


@pytest.mark.parametrize("measured", [True, False])
def test_vlora_train_flags_an_adapter_no_better_than_its_base(measured, tiny_zoo, vlora_home, tmp_path, capsys):
    from vlora.commands import train as train_command
    from vlora.config import compose

    path = _learned_nothing(vlora_home, tiny_zoo, tmp_path)
    cfg = compose("train", ["train.base=model", "train.allow_random_base=true", f"train.dataset_dir={path}",
                            f"train.out_dir={tmp_path / 'qa_adapter'}", "train.max_steps=0", "adapter.rank=4",
                            "train.max_new_tokens=4", f"train.zero_shot_baseline={str(measured).lower()}"])
    train_command.run(cfg)
    printed = capsys.readouterr().out
    baselines = json.loads((tmp_path / "qa_adapter" / "meta.json").read_text())["domains"]["qa"]["baselines"]
    assert baselines["teacher_vs_truth"] is None, "the fixture's labels are the truth itself: nothing recorded"
    if not measured:
        assert baselines["zero_shot"] is None and "not measured" in printed and "ZERO-SHOT" not in printed
        return
    shot = baselines["zero_shot"]
    assert (shot["wins"], shot["better"]) == (0, False)
    assert "NO BETTER THAN ZERO-SHOT: qa exact_match" in printed and "no better than the base model" in printed
    assert "NO BETTER THAN MAJORITY: qa" in printed
