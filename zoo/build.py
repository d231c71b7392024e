"""Builds Hugging Face-format checkpoint directories of the zoo's models with seeded random weights.

A directory holds what `from_pretrained` expects of a real checkpoint (config.json,
generation_config.json, model.safetensors, tokenizer and processor files) plus `zoo.json`,
which records the spec and seed it was built from and that its weights are random
(`"weights": "random"`). That record travels with a copy of the directory, so `random_weights`
still knows the copy for what it is; a checkpoint saved by `save_pretrained` elsewhere (a world
pretraining, a user's fine-tune) has no zoo.json and counts as trained. Building is atomic (a
temporary directory renamed at the end), so an interrupted build never leaves a half checkpoint
behind.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import torch

from .configs import hf_config
from .specs import ModelSpec, get_spec
from .tokenizer import build_llava_tokenizer, build_qwen_tokenizer

ZOO_FILE = "zoo.json"
RANDOM = "random"  # zoo.json "weights": what build_checkpoint writes (seeded random initialisation)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tokenizer_and_ids(spec: ModelSpec):
    """The spec's offline tokenizer and the special-token ids its config needs."""
    if spec.arch == "llava":
        tok = build_llava_tokenizer(spec.tokenizer_vocab)
        image = tok.convert_tokens_to_ids("<image>")
        ids = dict(bos=tok.bos_token_id, eos=tok.eos_token_id, pad=tok.pad_token_id, image=image)
    else:
        tok = build_qwen_tokenizer(spec.tokenizer_vocab)
        ids = {name: tok.convert_tokens_to_ids(token) for name, token in [
            ("bos", "<|endoftext|>"), ("eos", "<|im_end|>"), ("pad", "<|endoftext|>"),
            ("image", "<|image_pad|>"), ("video", "<|video_pad|>"),
            ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>")]}
    return tok, ids


def build_processor(spec: ModelSpec, tokenizer):
    from transformers import (CLIPImageProcessor, LlavaProcessor, Qwen2_5_VLProcessor, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    v = spec.vision
    if spec.arch == "llava":
        side = v.image_size
        image_processor = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        # num_additional_image_tokens=1: CLIP's CLS token, which the "default" strategy drops again.
        return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=v.patch_size,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1,
                              chat_template=tokenizer.chat_template)
    size = {"shortest_edge": spec.image.min_pixels, "longest_edge": spec.image.max_pixels}
    common = dict(size=size, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                  merge_size=v.spatial_merge_size)
    video = dict(common)
    if hasattr(Qwen2VLVideoProcessor, "cap_pixels_per_frame"):
        # Newer transformers ask for an explicit choice; False keeps the behaviour of older ones.
        video["cap_pixels_per_frame"] = False
    cls = Qwen2VLProcessor if spec.arch == "qwen2_vl" else Qwen2_5_VLProcessor
    return cls(image_processor=Qwen2VLImageProcessor(**common), tokenizer=tokenizer,
               video_processor=Qwen2VLVideoProcessor(**video), chat_template=tokenizer.chat_template)


def build_model(spec: ModelSpec, ids: dict[str, int], seed: int, dtype: str = "float32", device: str = "cpu"):
    """A randomly initialised model of the spec; the same seed gives the same weights."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    config = hf_config(spec, ids)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=DTYPES[dtype])
    eos = [ids["eos"]] + ([ids["pad"]] if spec.arch != "llava" else [])
    model.generation_config = GenerationConfig(bos_token_id=ids["bos"], eos_token_id=eos,
                                               pad_token_id=ids["pad"], do_sample=False)
    return model.eval()


def build_checkpoint(name: str, out_dir: str | Path, seed: int = 0, dtype: str | None = None,
                     device: str = "cpu", overwrite: bool = False) -> Path:
    """Writes the checkpoint directory of zoo model `name` to `out_dir` and returns its path.

    dtype defaults to float32 for tiny and small models (trained from scratch) and bfloat16 for full
    sizes (as published).
    An existing directory built from the same spec and seed is kept unless `overwrite`.
    """
    spec = get_spec(name)
    dtype = dtype or ("bfloat16" if spec.size == "full" else "float32")
    out_dir = Path(out_dir)
    record = {"name": name, "seed": seed, "dtype": dtype, "spec": dataclasses.asdict(spec), "weights": RANDOM}
    if out_dir.exists() and not overwrite:
        existing = read_zoo_record(out_dir)
        if existing is not None:
            existing.setdefault("weights", RANDOM)  # written before the field existed: random all the same
        if existing == json.loads(json.dumps(record)):
            return out_dir
        raise FileExistsError(f"{out_dir} exists and was not built from zoo model {name!r} with seed {seed} "
                              f"and dtype {dtype}; pass overwrite=True (zoo.overwrite=true) to replace it")
    tokenizer, ids = build_tokenizer_and_ids(spec)
    processor = build_processor(spec, tokenizer)
    model = build_model(spec, ids, seed, dtype, device)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is shared like any directory
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        (tmp / ZOO_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def read_zoo_record(path: str | Path) -> dict | None:
    """The zoo.json of a checkpoint directory, or None for a checkpoint from elsewhere."""
    file = Path(path) / ZOO_FILE
    return json.loads(file.read_text()) if file.exists() else None


def random_weights(path: str | Path) -> dict | None:
    """The zoo.json of the checkpoint at `path` when it says the weights are the zoo's random ones
    (a build, or a copy of one), else None: a checkpoint from elsewhere is taken as trained."""
    record = read_zoo_record(path)
    # records written before the "weights" field came only from build_checkpoint: random too
    return record if record is not None and record.get("weights", RANDOM) == RANDOM else None
