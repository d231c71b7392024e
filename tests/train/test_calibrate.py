"""Calibrating a detect head's score threshold: the F1-best threshold of the train split is chosen,
kept in the head's config through saving and loading, set by training and fusion when asked, and
evaluation reports what the default threshold would have scored."""

from __future__ import annotations

import dataclasses
import io
import os

import pytest
import torch
from train_fixtures import tiny_domain

from heads import DenseDetectHead, build_head, f1_at_iou, load_head, xyxy_to_cxcywh
from train import (HeadState, LoraSpec, LoraTrainer, ModelRef, TrainConfig, VisionLM, evaluate, head_config_for,
                   load_adapter, load_domain, save_adapter, train_adapter)
from train.calibrate import calibrate_threshold
from train.evaluate import head_outputs

QUIET = open(os.devnull, "w")
TRUE_SCORE, FALSE_SCORE = 0.32, 0.12  # true boxes score under 0.5; one false box a picture scores lower
FALSE_BOX = [0.9, 0.9, 1.0, 1.0]
BEST = 0.3  # of the grid, the thresholds in [0.15, 0.3] keep exactly the true boxes; 0.3 is nearest 0.5


class PlantedHead(DenseDetectHead):
    """The real dense head, whose eval-mode outputs are planted: item k of the split being read gets
    its true boxes `plan[k]` at TRUE_SCORE and FALSE_BOX at FALSE_SCORE on its first visual tokens,
    every other token scoring nothing. Training runs the head as it is."""

    def __init__(self, config, plan):
        super().__init__(config)
        self.plan, self.seen = plan, 0

    def train(self, mode: bool = True):
        self.seen = 0  # evaluation and calibration switch to eval mode, then read the split in order
        return super().train(mode)

    def forward(self, hidden, attention_mask=None, token_xy=None):
        out = super().forward(hidden, attention_mask, token_xy)
        if self.training:
            return out
        logits, boxes = torch.full_like(out["logits"], -1e4), out["boxes"].detach().clone()
        for b in range(hidden.shape[0]):
            true = self.plan[self.seen % len(self.plan)]
            self.seen += 1
            tokens = out["visual"][b].nonzero().flatten().tolist()
            for token, box, score in zip(tokens, true + [FALSE_BOX], [TRUE_SCORE] * len(true) + [FALSE_SCORE]):
                logits[b, token] = torch.logit(torch.tensor(score))
                boxes[b, token] = xyxy_to_cxcywh(torch.tensor(box))
        return {**out, "logits": logits, "boxes": boxes}


@pytest.fixture(scope="module")
def setup(tiny_zoo, vlora_home):
    vlm = VisionLM(ModelRef("qwen2_vl_tiny", str(tiny_zoo["qwen2_vl_tiny"])), LoraSpec(rank=4, alpha=8), device="cpu")
    tiny_domain(vlora_home, "exists_bus", tiny_zoo["qwen2_vl_tiny"], limit=12)
    data = load_domain(tiny_domain(vlora_home, "detect_car", tiny_zoo["qwen2_vl_tiny"], limit=12))
    plan = [list(map(list, boxes)) for boxes in data.splits["train"]["boxes"]]
    assert sum(map(len, plan)) >= 5 and any(len(b) < data.info.max_boxes for b in plan), \
        "cars to find, and pictures where the false box is not cut by max_boxes"
    return vlm, data, plan


def planted(vlm, data, plan) -> PlantedHead:
    torch.manual_seed(0)
    return PlantedHead(head_config_for(data.info, vlm.hidden_size), plan)


def test_calibration_picks_the_best_threshold_and_evaluate_shows_both(setup):
    vlm, data, plan = setup
    head = planted(vlm, data, plan)
    assert head.config.score_threshold == 0.5
    out = calibrate_threshold(vlm, head, data, batch_size=4)
    assert out["threshold"] == BEST == head.config.score_threshold
    assert out["default_threshold"] == 0.5 and out["default_f1"] == 0.0 < out["f1"]
    assert out["items"] == data.size("train") and out["split"] == "train"

    # the reported F1 is the F1 of the head's boxes at that threshold, computed afresh
    preds, targets = [], []
    for outputs, batch_targets in head_outputs(vlm, head.eval(), data, "train", data.size("train"), 5):
        preds += [r.boxes for r in head.decode(outputs, threshold=BEST)]
        targets += batch_targets
    assert out["f1"] == pytest.approx(f1_at_iou(preds, targets, 0.5))
    for worse in (0.1, 0.5):  # a false positive a picture, or none of the true boxes
        preds = [r.boxes for o, _ in head_outputs(vlm, head.eval(), data, "train", data.size("train"), 32)
                 for r in head.decode(o, threshold=worse)]
        assert f1_at_iou(preds, targets, 0.5) < out["f1"]

    metrics = evaluate(vlm, head, data, "train", batch_size=4)
    assert metrics["accuracy"] == pytest.approx(out["f1"]) and metrics["f1_at_0.5"] == 0.0

    # of thresholds scoring the same, the current one stays
    head.config = dataclasses.replace(head.config, score_threshold=0.2)
    assert calibrate_threshold(vlm, head, data)["threshold"] == 0.2
    head.config = dataclasses.replace(head.config, score_threshold=0.5)
    assert "f1_at_0.5" not in evaluate(vlm, head, data, "train"), "at the default, nothing to compare"


def test_other_tasks_are_untouched_and_an_empty_split_is_named(setup, vlora_home):
    vlm, data, plan = setup
    bus = load_domain(vlora_home / "datasets" / "exists_bus")
    head = build_head(head_config_for(bus.info, vlm.hidden_size))
    config, weights = head.config, {k: v.clone() for k, v in head.state_dict().items()}
    assert calibrate_threshold(vlm, head, bus) == {}
    assert head.config is config and all(torch.equal(v, head.state_dict()[k]) for k, v in weights.items())

    empty = dataclasses.replace(data, splits={**data.splits, "train": data.splits["train"].select([])})
    with pytest.raises(ValueError, match="domain 'detect_car': split 'train' is empty"):
        calibrate_threshold(vlm, planted(vlm, data, plan), empty)


def test_train_adapter_calibrates_before_its_evaluation(setup):
    vlm, data, plan = setup
    for on in (True, False):
        vlm.reset_lora(0)
        log = io.StringIO()
        cfg = TrainConfig(epochs=1, batch_size=4, lr=1e-3, calibrate_threshold=on)
        result = train_adapter(vlm, data, cfg, head=planted(vlm, data, plan), log=log)
        lines = log.getvalue().splitlines()
        if on:
            assert result.head.config.score_threshold == BEST and "f1_at_0.5" in result.metrics
            calibrated = lines.index("[calibrate] detect_car: threshold 0.3 (train F1 1.00; 0.5 gave 0.00)")
            assert calibrated < next(i for i, line in enumerate(lines) if " eval f1@0.5 " in line)
        else:
            assert result.head.config.score_threshold == 0.5 and "f1_at_0.5" not in result.metrics
            assert not any("[calibrate]" in line for line in lines)


def test_fusion_trainer_calibrates_new_and_refitted_heads_and_saving_keeps_it(setup, vlora_home, tmp_path):
    vlm, data, plan = setup
    log = io.StringIO()
    trainer = LoraTrainer(vlm, vlora_home / "datasets", TrainConfig(epochs=1, batch_size=4, lr=1e-3), log=log,
                          refit_epochs=1)
    trainer._head = lambda state, name, d: planted(vlm, d, plan)
    first = trainer.train(trainer.new_adapter(0), "detect_car")
    assert first.heads["detect_car"].config["score_threshold"] == BEST
    assert "[calibrate] detect_car: threshold 0.3 (train F1 1.00; 0.5 gave 0.00)" in log.getvalue()

    path = save_adapter(vlm, first, tmp_path / "car")
    assert load_adapter(path).heads["detect_car"].config["score_threshold"] == BEST
    assert load_head(path / "heads" / "detect_car").config.score_threshold == BEST
    assert HeadState.of(first.heads["detect_car"].build()).config["score_threshold"] == BEST

    # a domain joining re-fits the member's head on the new LoRA, so the member is calibrated again
    del trainer._head  # the joining domain gets a head of its own
    second = trainer.train(first, "exists_bus")
    lines = [line for line in log.getvalue().splitlines() if line.startswith("[calibrate]")]
    assert len(lines) == 2 and all(line.startswith("[calibrate] detect_car:") for line in lines)
    assert second.heads["exists_bus"].config["score_threshold"] == 0.5

    off = LoraTrainer(vlm, vlora_home / "datasets", TrainConfig(epochs=1, batch_size=4, calibrate_threshold=False),
                      log=QUIET)
    off._head = lambda state, name, d: planted(vlm, d, plan)
    assert off.train(off.new_adapter(0), "detect_car").heads["detect_car"].config["score_threshold"] == 0.5
