"""Fusion that keeps what it fused: the mixed batch stream (rehearsal) and head re-fits."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from train_fixtures import tiny_domain

from fusion import Domain
from train import LoraSpec, LoraTrainer, ModelRef, TrainConfig, VisionLM, load_domain
from train.data import head_target
from train.evaluate import hidden_states
from train.rehearsal import Part, _epoch_batches, refit_heads, rehearsal_parts

QUIET = open(os.devnull, "w")


@pytest.fixture(scope="module")
def setup(tiny_zoo, vlora_home):
    vlm = VisionLM(ModelRef("qwen2_vl_tiny", str(tiny_zoo["qwen2_vl_tiny"])), LoraSpec(rank=4, alpha=8), device="cpu")
    for name, limit in (("exists_bus", 12), ("color_largest", 16), ("qa", 8)):
        tiny_domain(vlora_home, name, tiny_zoo["qwen2_vl_tiny"], limit=limit)
    return vlm, vlora_home / "datasets"


def test_epoch_stream_holds_the_new_domain_once_and_the_members_share(setup):
    _, root = setup
    new = Part(load_domain(root / "color_largest"), None)
    members = [Part(load_domain(root / "exists_bus"), None), Part(load_domain(root / "qa"), None)]
    n_new = new.data.size("train")
    parts = rehearsal_parts(new, members, 1.0)
    each = -(-n_new // 2)  # a share of 1.0 split between two members, capped by their train sizes
    assert [p.rows_per_epoch for p in parts] == [None] + [min(each, m.data.size("train")) for m in members]
    batches = _epoch_batches(parts, 4, seed=0, epoch=0)
    rows = Counter()
    for p, idx in batches:
        assert len(idx) <= 4 and len(set(idx)) == len(idx)
        rows[p] += len(idx)
    assert rows[0] == n_new and rows[1] == parts[1].rows_per_epoch and rows[2] == parts[2].rows_per_epoch
    assert [p for p, _ in batches] != sorted(p for p, _ in batches), "domains are interleaved, not in turn"
    assert batches == _epoch_batches(parts, 4, seed=0, epoch=0) != _epoch_batches(parts, 4, seed=0, epoch=1)
    assert rehearsal_parts(new, members, 0.0) == [new]
    with pytest.raises(ValueError, match="rehearsal share"):
        rehearsal_parts(new, members, -0.5)


def _head_loss(vlm, head, data) -> float:
    rows = [data.splits["train"][i] for i in range(data.size("train"))]
    hidden, mask = hidden_states(vlm, [vlm.encoder.encode(r, data.info) for r in rows])
    with torch.no_grad():
        out = head(hidden.float(), mask)
        return float(head.loss(out, head.targets_from([head_target(data.info, r) for r in rows])))


def test_joining_domain_rehearses_members_and_refits_their_heads(setup):
    vlm, root = setup
    cfg = TrainConfig(epochs=1, batch_size=4, lr=5e-3, head_lr=1e-2)
    trainer = LoraTrainer(vlm, root, cfg, log=QUIET, rehearsal=1.0, refit_epochs=3)
    first = trainer.train(trainer.new_adapter(0), Domain("exists_bus", "binary", 0.0))
    first = trainer.train(first, Domain("qa", "lm", 0.0))  # an lm member has no head to re-fit
    lora_before = {k: v.clone() for k, v in first.lora.items()}
    head_before = {k: v.clone() for k, v in first.heads["exists_bus"].weights.items()}
    second = trainer.train(first, Domain("color_largest", "classify", 0.0))
    assert all(torch.equal(first.lora[k], v) for k, v in lora_before.items()), "train must not touch its argument"
    assert all(torch.equal(first.heads["exists_bus"].weights[k], v) for k, v in head_before.items())
    assert list(second.heads) == ["exists_bus", "color_largest"] and list(second.domains) == [
        "exists_bus", "qa", "color_largest"]
    assert any(not torch.equal(second.heads["exists_bus"].weights[k], v) for k, v in head_before.items()), \
        "the member's head trained with the stream and was re-fitted"
    # One epoch over color_largest (batches of 4) plus the members' rehearsed rows.
    n_new = trainer.dataset("color_largest").size("train")
    each = -(-n_new // 2)
    want = -(-n_new // 4) + sum(-(-min(each, trainer.dataset(m).size("train")) // 4) for m in ("exists_bus", "qa"))
    assert second.domains["color_largest"]["steps"] == want


def test_refit_lowers_a_stale_heads_loss_and_leaves_the_lora(setup):
    vlm, root = setup
    cfg = TrainConfig(epochs=1, batch_size=4, lr=5e-2, head_lr=1e-2)
    trainer = LoraTrainer(vlm, root, cfg, log=QUIET)
    bus = trainer.train(trainer.new_adapter(1), Domain("exists_bus", "binary", 0.0))
    moved = trainer.train(bus, Domain("color_largest", "classify", 0.0))  # no rehearsal: the bus head is stale
    vlm.load_lora_state(moved.lora)
    data = trainer.dataset("exists_bus")
    head = moved.heads["exists_bus"].build()
    stale = _head_loss(vlm, head, data)
    lora = {k: v.clone() for k, v in vlm.lora_state().items()}
    refit_heads(vlm, [Part(data, head)], cfg, epochs=20, log=QUIET)
    assert _head_loss(vlm, head, data) < 0.8 * stale
    assert all(torch.equal(vlm.lora_state()[k], v) for k, v in lora.items()), "the LoRA stays frozen"
    with pytest.raises(ValueError, match="refit_epochs"):
        LoraTrainer(vlm, root, cfg, refit_epochs=-1)


def test_a_domain_trains_for_its_own_epochs_alone_and_with_rehearsal(setup):
    vlm, root = setup
    cfg = TrainConfig(epochs=1, batch_size=4, lr=5e-3, head_lr=1e-2)
    trainer = LoraTrainer(vlm, root, cfg, log=QUIET, rehearsal=1.0, epochs={"color_largest": 3})
    assert trainer.settings["epochs"] == {"color_largest": 3}  # a journal refuses other counts
    bus = trainer.train(trainer.new_adapter(2), Domain("exists_bus", "binary", 0.0))
    assert bus.domains["exists_bus"]["steps"] == -(-trainer.dataset("exists_bus").size("train") // 4)  # train.epochs
    alone = trainer.train(trainer.new_adapter(3), Domain("color_largest", "classify", 0.0))
    n_new = trainer.dataset("color_largest").size("train")
    assert alone.domains["color_largest"]["steps"] == 3 * -(-n_new // 4)
    joined = trainer.train(bus, Domain("color_largest", "classify", 0.0))  # its rehearsal runs 3 epochs too
    rehearsed = -(-min(n_new, trainer.dataset("exists_bus").size("train")) // 4)
    assert joined.domains["color_largest"]["steps"] == 3 * (-(-n_new // 4) + rehearsed)
    assert "epochs" not in LoraTrainer(vlm, root, cfg).settings  # journals written before still resume
    with pytest.raises(ValueError, match="epochs per domain"):
        LoraTrainer(vlm, root, cfg, epochs={"color_largest": 0})
