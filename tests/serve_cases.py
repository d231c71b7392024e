"""Shared cases of the engine tests: requests with and without images (and video for Qwen), and
the Hugging Face transformers oracle that runs each request alone through `generate`."""

from __future__ import annotations

import functools

import numpy as np
import torch
from PIL import Image

from serve import Request, SamplingParams

MAX_NEW = 6
LOGITS_ATOL = 1e-4  # fp32: our logits vs transformers' at every generated position


def image(seed: int, h: int = 100, w: int = 150) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def frames(seed: int, n: int = 4, side: int = 56) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, side, side, 3), dtype=np.uint8)


def case_specs(arch: str) -> list[dict]:
    """A mixed batch: one image, none, two images with a longer prompt, (Qwen) a video clip."""
    specs = [
        dict(prompt="How many cars?", images=[image(0)]),
        dict(prompt="Describe the street in one short sentence, please."),
        dict(prompt="Which of the two pictures shows more red trucks near the crossing?",
             images=[image(1, 64, 80), image(2, 90, 60)]),
    ]
    if arch != "llava":
        specs.append(dict(prompt="Which way?", video=frames(3)))
    return specs


def make_request(spec: dict, max_new: int = MAX_NEW, **sampling) -> Request:
    params = SamplingParams(max_tokens=max_new, keep_logits=True, **sampling)
    return Request(prompt=spec["prompt"], images=list(spec.get("images", [])), video=spec.get("video"),
                   sampling=params)


def staggered(engine, specs: list[dict]) -> list:
    """Final outputs of `specs` arriving one every two steps, each joining the running batch."""
    ids, final = [], {}
    for spec in specs:
        ids.append(engine.add_request(make_request(spec)))
        for _ in range(2):
            final.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return [final[i] for i in ids]


@functools.lru_cache(maxsize=None)
def hf_model(path: str):
    from zoo import load_pretrained

    return load_pretrained(path)


def hf_inputs(processor, spec: dict):
    content = [{"type": "image"} for _ in spec.get("images", [])]
    if spec.get("video") is not None:
        content.append({"type": "video"})
    messages = [{"role": "user", "content": content + [{"type": "text", "text": spec["prompt"]}]}]
    kwargs = {"text": [processor.apply_chat_template(messages, add_generation_prompt=True)], "return_tensors": "pt"}
    if spec.get("images"):
        kwargs["images"] = [Image.fromarray(im) for im in spec["images"]]
    if spec.get("video") is not None:
        kwargs["videos"] = [spec["video"]]
    return processor(**kwargs)


def hf_generate(path: str, spec: dict, max_new: int = MAX_NEW) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens (up to and including an end-of-sequence token) and the raw logits of each step."""
    model, processor = hf_model(str(path))
    inputs = hf_inputs(processor, spec)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [step[0].float() for step in out.logits][:len(tokens)]


def assert_matches_hf(outputs, references) -> None:
    for i, (out, (tokens, logits)) in enumerate(zip(outputs, references)):
        assert out.token_ids == tokens, f"request {i}: engine {out.token_ids} vs transformers {tokens}"
        got = torch.stack(out.logits)
        diff = (got - torch.stack(logits)).abs().max().item()
        assert diff < LOGITS_ATOL, f"request {i}: logits differ by {diff}"
