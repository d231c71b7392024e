"""World pretraining of a tiny zoo model: exact targets, a loadable cached checkpoint, resume."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from train import PretrainConfig, cached_pretrained, pretrain
from train.pretrain_data import DIRECTION_LABELS, dense_targets, encode_example, sample_example
from world import WorldConfig, caption
from zoo import load_pretrained

WORLD = WorldConfig(seed=42)
TINY = dict(steps=6, batch_size=2, turns=2, warmup_steps=2, save_every=2, lr=3e-3)


def test_region_targets_follow_the_truth():
    ex = next(e for e in (sample_example(WORLD, i, False, 3, 4, 0) for i in range(50))
              if len(e.frame_objects[0]) >= 3)
    targets = dense_targets(ex, (1, 8, 8), WORLD.classes, WORLD.colors).view(8, 8, 8)
    objs = ex.frame_objects[0]
    centres = {(min(int((o.box[1] + o.box[3]) / 2 / 28), 7), min(int((o.box[0] + o.box[2]) / 2 / 28), 7))
               for o in objs}
    assert int(targets[..., 2].sum()) == len(centres)
    labelled = {WORLD.classes[c - 1] for c in targets[..., 0].unique().tolist() if c > 0}
    assert labelled <= {o.cls for o in objs} and labelled
    assert (targets[..., 0] == 0).sum() > 8 * 8 // 2, "most of a road scene is background"
    assert ((targets[..., 0] > 0) == (targets[..., 1] > 0)).all(), "a labelled cell has a class and a colour"
    assert (targets[..., 3] == -100).all(), "images have no motion to learn"
    held = targets[..., 0] > 0
    assert (targets[..., 4:][held] >= 0).all() and (targets[..., 4:][~held] == -1).all()
    boxes = {tuple(round(1000 * v / 224) for v in o.box) for o in objs}
    assert {tuple(b) for b in targets[..., 4:][held].tolist()} <= boxes

    clip = next(e for e in (sample_example(WORLD, i, True, 3, 4, 0) for i in range(50)) if e.frame_objects[0])
    motion = dense_targets(clip, (2, 8, 8), WORLD.classes, WORLD.colors)
    moving = motion[motion[:, 0] > 0, 3]
    assert (moving > 0).all() and set(moving.tolist()) <= set(range(1, len(DIRECTION_LABELS)))
    assert len(clip.media) == 4 and clip.media[0].shape == (WORLD.height, WORLD.width, 3)


def test_conversation_answers_are_the_truth_and_only_answers_are_supervised(tiny_zoo):
    _, processor = load_pretrained(tiny_zoo["qwen2_vl_tiny"])
    rng_items = [sample_example(WORLD, i, False, 11, 4, 0) for i in range(6)]
    from world import render_image

    for i, ex in enumerate(rng_items):
        described = [a for q, a in ex.turns if q == "Describe the image."]
        assert described == [caption(render_image(WORLD, i)[1])]
    ex = rng_items[0]
    enc = encode_example(processor, ex, WORLD.classes, WORLD.colors, [processor.tokenizer.convert_tokens_to_ids(
        "<|image_pad|>")])
    supervised = processor.tokenizer.decode(enc["labels"][enc["labels"] != -100])
    assert supervised == "".join(a + "<|im_end|>" for _, a in ex.turns)
    assert enc["dense"].shape == (64, 8) and enc["input_ids"].shape == enc["mm_token_type_ids"].shape


def test_pretrain_writes_a_loadable_cached_checkpoint(tiny_zoo, tmp_path):
    cfg = PretrainConfig(**TINY)
    log = io.StringIO()
    out = pretrain(tiny_zoo["qwen2_vl_tiny"], tmp_path / "pre", cfg, log=log)
    record = json.loads((out / "pretrain.json").read_text())
    assert record["steps_done"] == 6 and record["base_zoo"]["name"] == "qwen2_vl_tiny"
    first, last = record["loss_first"], record["loss_last"]
    assert sum(r for _, r in last[-2:]) < sum(r for _, r in first[:2]), "the region loss falls"
    model, _ = load_pretrained(out)
    base, _ = load_pretrained(tiny_zoo["qwen2_vl_tiny"])
    assert not torch.equal(model.model.visual.patch_embed.proj.weight, base.model.visual.patch_embed.proj.weight)
    assert not (out.parent / "pre.partial").exists()

    mtime = (out / "model.safetensors").stat().st_mtime_ns
    again = io.StringIO()
    assert pretrain(tiny_zoo["qwen2_vl_tiny"], out, cfg, log=again) == out
    assert "kept" in again.getvalue() and (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert cached_pretrained(tiny_zoo["qwen2_vl_tiny"], out, PretrainConfig(**{**TINY, "lr": 1e-3})) is None


def test_a_pretraining_with_other_settings_goes_beside_the_cached_one(tiny_zoo, tmp_path):
    """The base another run built stays where adapters recorded it; a run with another seed
    builds its own beside it, and each is found again by a run with its settings."""
    first_cfg, other_cfg = PretrainConfig(**TINY), PretrainConfig(**{**TINY, "seed": 1})
    first = pretrain(tiny_zoo["qwen2_vl_tiny"], tmp_path / "pre", first_cfg, log=io.StringIO())
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    log = io.StringIO()
    other = pretrain(tiny_zoo["qwen2_vl_tiny"], tmp_path / "pre", other_cfg, log=log)
    assert other != first and other.parent == first.parent and other.name.startswith("pre-")
    assert "seed 1 (there 0)" in log.getvalue() and f"is {other}" in log.getvalue()
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime, "the first base is untouched"
    assert json.loads((other / "pretrain.json").read_text())["config"]["seed"] == 1
    for cfg, where in ((other_cfg, other), (first_cfg, first)):
        again = io.StringIO()
        assert pretrain(tiny_zoo["qwen2_vl_tiny"], tmp_path / "pre", cfg, log=again) == where
        assert "kept" in again.getvalue()


class Preempted(RuntimeError):
    pass


class PreemptingLog(io.StringIO):
    """Progress output that stops the run (like a preemption) when a given step is reported."""

    def __init__(self, at: str):
        super().__init__()
        self.at = at

    def write(self, text: str) -> int:
        if self.at in text:
            raise Preempted(text)
        return super().write(text)

    def isatty(self) -> bool:  # a terminal's progress shows every step (a log's, one every 30 s)
        return True


def test_pretrain_resumes_to_the_uninterrupted_result(tiny_zoo, tmp_path):
    """Two vision-only steps, then six full ones; preempted during step 7, resumed from step 6."""
    cfg = PretrainConfig(**TINY, vision_steps=2, vision_batch_size=3)
    whole = pretrain(tiny_zoo["qwen2_vl_tiny"], tmp_path / "whole", cfg, log=io.StringIO())
    assert json.loads((whole / "pretrain.json").read_text())["steps_done"] == 8
    with pytest.raises(Preempted):
        pretrain(tiny_zoo["qwen2_vl_tiny"], tmp_path / "cut", cfg, log=PreemptingLog("step 7/8"))
    assert (tmp_path / "cut.partial" / "state.pt").is_file() and not (tmp_path / "cut").exists()
    log = io.StringIO()
    cut = pretrain(tiny_zoo["qwen2_vl_tiny"], tmp_path / "cut", cfg, log=log)
    assert "resumed at step 6" in log.getvalue()
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(cut / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_batches_from_loader_workers_train_the_same_weights(tiny_zoo, tmp_path):
    """Scenes rendered and encoded in worker processes are the batches the loop would build itself."""
    cfg = PretrainConfig(**{**TINY, "steps": 3})
    inline = pretrain(tiny_zoo["qwen2_vl_tiny"], tmp_path / "inline", cfg, log=io.StringIO())
    workers = pretrain(tiny_zoo["qwen2_vl_tiny"], tmp_path / "workers", PretrainConfig(**{**TINY, "steps": 3, "workers": 2}),
                       log=io.StringIO())
    a, b = load_file(str(inline / "model.safetensors")), load_file(str(workers / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # where and how the steps run is not part of the cache key; precision is, once it is not full
    assert cached_pretrained(tiny_zoo["qwen2_vl_tiny"], inline, PretrainConfig(**{**TINY, "steps": 3, "device": "cpu",
                                                                                 "workers": 3})) == inline
    assert cached_pretrained(tiny_zoo["qwen2_vl_tiny"], inline,
                             PretrainConfig(**{**TINY, "steps": 3, "mixed_precision": "bf16"})) is None


@pytest.mark.parametrize("bad", [{"device": "tpu"}, {"mixed_precision": "fp8"}, {"workers": -1}])
def test_bad_runtime_settings_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        PretrainConfig(**bad)


def test_llava_pretrains_on_images(tiny_zoo, tmp_path):
    cfg = PretrainConfig(**{**TINY, "steps": 1, "vision_steps": 1, "vision_batch_size": 2})
    out = pretrain(tiny_zoo["llava_1_5_tiny"], tmp_path / "llava", cfg, log=io.StringIO())
    model, processor = load_pretrained(out)
    assert model.config.model_type == "llava" and processor.tokenizer is not None


def test_defaults_match_conf_pretrain_yaml():
    """`vlora train` builds a missing pretraining from PretrainConfig's defaults: they must be the
    settings `vlora pretrain` uses, or the two would make (and cache) different checkpoints."""
    conf = OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "pretrain.yaml")
    values = OmegaConf.to_container(conf["pretrain"], resolve=False)
    defaults = PretrainConfig()
    for key, value in values.items():
        if key in ("out", "force", "seed"):  # interpolated from the command's config
            continue
        assert getattr(defaults, key) == value, key
    assert set(values) - {"out", "force"} == set(PretrainConfig.__dataclass_fields__)


def test_train_commands_take_pretraining_settings(tiny_zoo, vlora_home, tmp_path):
    """`train.pretrain` reaches the pretraining `vlora train` / `vlora fusion` build (a larger model
    needs more steps than the tiny default), and a key it does not know is named."""
    from vlora.commands.train import model_ref, split_train_node
    from vlora.config import compose

    out = tmp_path / "pre"
    cfg = compose("train", [f"model.path={tiny_zoo['qwen2_vl_tiny']}", f"train.pretrained_dir={out}",
                            "train.pretrain={steps: 2, batch_size: 2, save_every: 1, warmup_steps: 1}"])
    job, _ = split_train_node(cfg.train)
    ref = model_ref(cfg, job)
    assert Path(ref.path) == out and json.loads((out / "pretrain.json").read_text())["config"]["steps"] == 2
    bad = compose("train", [f"model.path={tiny_zoo['qwen2_vl_tiny']}", f"train.pretrained_dir={tmp_path / 'b'}",
                            "train.pretrain={stepz: 2}"])
    with pytest.raises(ValueError, match=r"train\.pretrain: PretrainConfig has no field\(s\) \['stepz'\]"):
        model_ref(bad, split_train_node(bad.train)[0])
    assert not (tmp_path / "b").exists(), "nothing is built for a bad key"
