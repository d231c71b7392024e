"""Training on a checkpoint with random weights is refused unless forced: `vlora train` (and fusion,
through the same entry) with train.base=model on a zoo build, or on a copy of one elsewhere, ends
with one line before any model loads; train.allow_random_base=true trains on it; a checkpoint
without the zoo's record (saved by transformers) is taken as trained and never refused."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from train_fixtures import tiny_domain

from vlora.commands import train as train_command
from vlora.commands.fusion import run_fusion
from vlora.config import compose
from zoo import build_checkpoint, load_pretrained, random_weights

WAYS_OUT = ("random weights", "answers noise", "train.base=pretrained", "vlora pretrain",
            "train.allow_random_base=true")


def _refusal(run, cfg) -> str:
    """The one line `run(cfg)` ends with, checked to come before any model loads (seconds, not a training)."""
    start = time.perf_counter()
    with pytest.raises(SystemExit) as exit_:
        run(cfg)
    assert time.perf_counter() - start < 5, "refused only after expensive work"
    line = str(exit_.value.code)
    assert "\n" not in line and line.startswith("train.base=model refused: ")
    for words in WAYS_OUT:
        assert words in line, f"{words!r} missing from: {line}"
    return line


def test_the_zoo_marks_its_random_checkpoints_and_a_copy_keeps_the_mark(tiny_zoo, tmp_path):
    built = tiny_zoo["qwen2_vl_tiny"]
    assert random_weights(built)["weights"] == "random" and random_weights(built)["name"] == "qwen2_vl_tiny"
    copy = shutil.copytree(built, tmp_path / "copy")
    assert random_weights(copy)["name"] == "qwen2_vl_tiny"
    # a record written before the "weights" field: still random, and still kept by a rebuild
    record = json.loads((copy / "zoo.json").read_text())
    del record["weights"]
    (copy / "zoo.json").write_text(json.dumps(record))
    assert random_weights(copy) is not None
    assert build_checkpoint("qwen2_vl_tiny", copy) == copy  # kept as it is, not rebuilt
    assert "weights" not in json.loads((copy / "zoo.json").read_text())
    model, processor = load_pretrained(built)  # saved by transformers: no zoo record, a checkpoint like any other
    model.save_pretrained(tmp_path / "saved")
    processor.save_pretrained(tmp_path / "saved")
    assert random_weights(tmp_path / "saved") is None and random_weights(tmp_path / "nothing") is None


def test_train_refuses_a_random_zoo_checkpoint_and_trains_on_it_when_forced(tiny_zoo, vlora_home, tmp_path):
    data = tiny_domain(vlora_home, "exists_bus", tiny_zoo["qwen2_vl_tiny"], limit=12)
    out = tmp_path / "bus"
    args = [f"model.path={tiny_zoo['qwen2_vl_tiny']}", "train.base=model", f"train.dataset_dir={data}",
            f"train.out_dir={out}", "train.epochs=1", "train.batch_size=4", "adapter.rank=4"]
    line = _refusal(train_command.run, compose("train", args))
    assert f"model.path {tiny_zoo['qwen2_vl_tiny']} holds zoo model 'qwen2_vl_tiny'" in line
    assert not out.exists(), "nothing written for a refused run"
    result = train_command.run(compose("train", [*args, "train.allow_random_base=true"]))
    assert (out / "adapter_model.safetensors").is_file() and result["metrics"]["exists_bus"]["n"] > 0


def test_a_copy_elsewhere_and_a_zoo_model_not_built_yet_are_refused(tiny_zoo, vlora_home, tmp_path):
    data = tiny_domain(vlora_home, "exists_bus", tiny_zoo["qwen2_vl_tiny"], limit=12)
    copy = shutil.copytree(tiny_zoo["qwen2_vl_tiny"], tmp_path / "my_checkpoint")
    common = ["train.base=model", f"train.dataset_dir={data}", f"train.out_dir={tmp_path / 'out'}"]
    # under a name of the user's own, so the record in the copy is what tells
    line = _refusal(train_command.run, compose("train", [f"model.path={copy}", "model.name=mine", *common]))
    assert f"model.path {copy} holds zoo model 'qwen2_vl_tiny'" in line
    missing = tmp_path / "zoo" / "qwen2_vl_tiny"
    line = _refusal(train_command.run, compose("train", [f"model.path={missing}", *common]))
    assert "is missing and would be built as zoo model 'qwen2_vl_tiny'" in line
    assert not missing.exists(), "the random checkpoint is not built only to be refused"


def test_fusion_refuses_a_random_base_before_building_the_model(tiny_zoo, vlora_home, tmp_path):
    cfg = compose("fusion", [f"model.path={tiny_zoo['qwen2_vl_tiny']}", "train.base=model",
                             "fusion.only={exists_bus: 0.3}", f"fusion.out_dir={tmp_path / 'fused'}"])
    _refusal(run_fusion, cfg)


def test_a_checkpoint_without_the_zoo_record_is_not_refused(tiny_zoo, tmp_path):
    model, processor = load_pretrained(tiny_zoo["qwen2_vl_tiny"])
    mine = tmp_path / "hf_checkpoint"
    model.save_pretrained(mine)
    processor.save_pretrained(mine)
    cfg = compose("train", [f"model.path={mine}", "model.name=mine", "train.base=model"])
    job, _ = train_command.split_train_node(cfg.train)
    ref = train_command.model_ref(cfg, job)
    assert ref.path == str(mine) and ref.name == "mine"
