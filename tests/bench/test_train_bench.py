"""`vlora bench bench.suite=train` on the CPU with the tiny model: both methods, same batches,
equal first-step LM loss, files, resume, and bad keys named before any work."""

from __future__ import annotations

import csv
import json
import math

import pytest

from vlora.commands.bench import run
from vlora.config import compose

TINY = ["bench.suite=train", "bench.train.models=[qwen2_vl_tiny]", "bench.train.device=cpu",
        "bench.train.dtype=float32", "bench.train.image_size=112", "bench.train.batch_size=2", "bench.train.epochs=2",
        "bench.train.warmup=1", "bench.train.dataset_size=4"]
POSITIVE = ("samples_per_s", "tokens_per_s", "tokens_per_sample", "visual_tokens_per_sample", "step_ms_median",
            "step_ms_mean", "model_tflop_per_step", "achieved_tflops", "matmul_peak_tflops", "mfu", "wall_s")


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_train_suite_on_cpu(tiny_zoo, tmp_path):
    cfg = compose("bench", TINY + ["bench.train.loss=lm", f"bench.out_dir={tmp_path}"])
    result = run(cfg)
    rows, meta = result["train"], result["meta"]
    assert [(r["method"], r["status"], r["loss"]) for r in rows] == [("ours", "ok", "lm"), ("plain", "ok", "lm")]
    for r in rows:
        assert all(r[k] > 0 for k in POSITIVE), r
        assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])
        assert r["peak_mem_gib"] is None  # measured on a GPU only
        assert r["visual_tokens_per_sample"] == 16  # 112 x 112: 8 x 8 patches, 2 x 2 merged
    ours, plain = rows
    # the same rows in the same order (hashed from what each method consumed), the same tokens
    assert ours["batches_sha"] == plain["batches_sha"]
    assert ours["tokens_per_sample"] == plain["tokens_per_sample"]
    # same rows, same LoRA init (B = 0): the cached-feature path equals transformers' full forward
    assert ours["first_loss"] == pytest.approx(plain["first_loss"], rel=1e-4)
    assert plain["vision_items_per_step"] == 2  # the tower runs on every item, every step
    assert ours["vision_items_per_step"] < 2  # 4 rows, 2 per step: the second epoch hits the cache
    entry = meta["models"]["qwen2_vl_tiny"]
    assert entry["first_loss_rel_diff"] < 1e-4 and entry["ours_over_plain_samples_per_s"] > 0
    assert entry["ours_over_plain_peak_mem"] is None
    out = tmp_path / "cpu"
    written = _csv(out / "train.csv")
    assert [(r["method"], r["status"]) for r in written] == [("ours", "ok"), ("plain", "ok")]
    assert all(float(r[k]) > 0 for r in written for k in POSITIVE)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gpu"] == "cpu" and summary["command"] and summary["date"]
    assert set(summary["versions"]) >= {"torch", "transformers", "peft"} and summary["matmul_peak_tflops"] > 0
    assert summary["ran"] == 2 and "2NT" in summary["flops_formula"]

    # a rerun skips the rows already in train.csv
    again = run(cfg)["meta"]
    assert (again["ran"], again["skipped"]) == (0, 2)
    assert _csv(out / "train.csv") == written

    # ours with the count head and gradient checkpointing is a new row; plain's row is kept
    cfg = compose("bench", TINY + ["bench.train.loss=head", "bench.train.gradient_checkpointing=true",
                                   f"bench.out_dir={tmp_path}"])
    head = run(cfg)
    assert (head["meta"]["ran"], head["meta"]["skipped"]) == (1, 1)
    new = head["train"][-1]
    assert (new["method"], new["loss"], new["gradient_checkpointing"], new["status"]) == ("ours", "head", True, "ok")
    assert math.isfinite(new["first_loss"]) and new["samples_per_s"] > 0
    assert new["batches_sha"] == plain["batches_sha"]
    assert new["tokens_per_sample"] < plain["tokens_per_sample"]  # the head needs no answer tokens
    assert len(_csv(out / "train.csv")) == 3


@pytest.mark.parametrize("override, key", [
    ("bench.train.methods=[ours,fancy]", "bench.train.methods"),
    ("bench.train.targets=[q_proj,qkv]", "bench.train.targets"),
    ("bench.train.models=[llava_1_5_tiny]", "bench.train.models"),
    ("bench.train.loss=mse", "bench.train.loss"),
    ("bench.train.dataset_size=1", "bench.train.dataset_size"),
])
def test_bad_keys_are_named(vlora_home, tmp_path, override, key):
    cfg = compose("bench", TINY + [override, f"bench.out_dir={tmp_path}"])
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        run(cfg)
    assert not (tmp_path / "cpu").exists()  # nothing written: the job failed before any work
