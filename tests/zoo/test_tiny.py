"""Tiny zoo checkpoints: they load through the Auto classes offline and generate from images and video."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from PIL import Image

from zoo import build_checkpoint, build_tokenizer_and_ids, get_spec, hf_config, load_pretrained

TINY = ("qwen2_vl_tiny", "qwen2_5_vl_tiny", "llava_1_5_tiny")


def _image(seed: int = 0, size: int = 224) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


def _files_digest(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("name", TINY)
def test_tiny_checkpoint_loads_and_generates_from_an_image(name, tiny_zoo):
    model, processor = load_pretrained(tiny_zoo[name])
    spec = get_spec(name)
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many cars?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(images=[_image()], text=[text], return_tensors="pt")
    n_image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    if spec.arch == "llava":
        assert n_image_tokens == (spec.vision.image_size // spec.vision.patch_size) ** 2
    else:  # 224 x 224 -> 16 x 16 patches, merged 2 x 2
        assert "mm_token_type_ids" in inputs and int(inputs["mm_token_type_ids"].sum()) == n_image_tokens
        assert n_image_tokens == 64
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 6)
    # The image matters: another image changes the next-token distribution.
    other = processor(images=[_image(1)], text=[text], return_tensors="pt")
    with torch.no_grad():
        a = model(**inputs).logits[0, -1]
        b = model(**other).logits[0, -1]
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "qwen2_5_vl_tiny"])
def test_qwen_tiny_generates_from_a_video(name, tiny_zoo):
    model, processor = load_pretrained(tiny_zoo[name])
    frames = np.random.default_rng(2).integers(0, 256, (8, 112, 112, 3), dtype=np.uint8)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which way?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(videos=[frames], text=[text], return_tensors="pt")
    assert int((inputs["input_ids"] == model.config.video_token_id).sum()) == 4 * 4 * 4  # t=8/2, 8x8 -> 4x4
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False, min_new_tokens=3)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 3


@pytest.mark.parametrize("name", TINY)
def test_special_tokens_lie_inside_the_vocabulary(name, tiny_zoo):
    config = json.loads((tiny_zoo[name] / "config.json").read_text())
    vocab = config["text_config"]["vocab_size"]
    _, processor = load_pretrained(tiny_zoo[name])
    tok = processor.tokenizer
    assert len(tok) <= vocab
    for token in tok.all_special_tokens:
        assert 0 <= tok.convert_tokens_to_ids(token) < vocab, token
    image_id = config.get("image_token_id", config.get("image_token_index"))
    assert tok.convert_ids_to_tokens(image_id) in ("<|image_pad|>", "<image>")


@pytest.mark.parametrize("name", ["qwen2_vl_tiny", "llava_1_5_tiny"])
def test_tokenizer_round_trips_any_text(name):
    tok, _ = build_tokenizer_and_ids(get_spec(name))
    for text in ["How many red cars are there?", "Ünïcödé → 東京 🚗", "x1=12, y1=7\n\ttab", ""]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_out_of_vocabulary_token_id_is_refused():
    spec = get_spec("qwen2_vl_tiny")
    _, ids = build_tokenizer_and_ids(spec)
    with pytest.raises(ValueError, match="image=4096 lies outside vocab_size 2048"):
        hf_config(spec, {**ids, "image": 4096})


def test_same_seed_gives_the_same_bytes_and_another_seed_other_weights(tmp_path, tiny_zoo):
    name = "qwen2_vl_tiny"
    again = build_checkpoint(name, tmp_path / "again", seed=0)
    other = build_checkpoint(name, tmp_path / "other", seed=1)
    reference = _files_digest(tiny_zoo[name])
    assert _files_digest(again) == reference
    other_digest = _files_digest(other)
    assert other_digest["model.safetensors"] != reference["model.safetensors"]
    assert other_digest["tokenizer.json"] == reference["tokenizer.json"]


def test_existing_directory_is_kept_or_refused(tmp_path):
    path = build_checkpoint("llava_1_5_tiny", tmp_path / "m", seed=3)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_checkpoint("llava_1_5_tiny", path, seed=3) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp, "same spec and seed: kept"
    with pytest.raises(FileExistsError, match="seed 4"):
        build_checkpoint("llava_1_5_tiny", path, seed=4)
    build_checkpoint("llava_1_5_tiny", path, seed=4, overwrite=True)
    assert json.loads((path / "zoo.json").read_text())["seed"] == 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary directory left"


def test_unknown_model_and_missing_checkpoint_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown zoo model 'qwen9'"):
        get_spec("qwen9")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_pretrained(tmp_path)
