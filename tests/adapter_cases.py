"""Adapters for the serving tests, made with plain PEFT on the tiny zoo models, and the PEFT oracle.

Adapters are what `get_peft_model(...).save_pretrained` writes, with lora_B randomised (PEFT
starts it at zero, which would make every check vacuous). Heads come from heads.build_head /
save_head. The oracle is Hugging Face transformers + PEFT with every adapter loaded into one
PeftModel and `adapter_names=` naming the adapter (or "__base__") of each request.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from serve_cases import MAX_NEW, hf_inputs

from heads import HeadConfig, build_head, save_head

@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny-model ops are too small to gain from a second thread, and on a shared 2-core machine
    two OpenMP threads wait on each other for whole time slices (steps 10-30x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


LM = r".*\.language_model\..*\."  # anchors targets on the language model (the towers have q_proj too)

# name -> (modules, r, alpha, extra LoraConfig arguments): different ranks, targets and scalings
ADAPTERS = {
    "qv8": (["q_proj", "v_proj"], 8, 16, {"use_rslora": True}),
    "all16": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 16, 16, {}),
    # mixed ranks inside the fused q/k/v and gate/up projections: k and up get rank 4 (scale folded)
    "mix": (["q_proj", "k_proj", "gate_proj", "up_proj", "down_proj"], 8, 24,
            {"rank_pattern": {"k_proj": 4, "up_proj": 4}}),
}


def make_adapter(base, out: str | Path, modules: list[str], r: int, alpha: float, seed: int,
                 b_std: float = 0.15, **extra) -> Path:
    """A PEFT LoRA directory adapting `modules` of the language model of `base` (a checkpoint
    directory, or a transformers model, which is left as it was)."""
    from peft import LoraConfig, get_peft_model

    from zoo import load_pretrained

    model = load_pretrained(base)[0] if isinstance(base, (str, Path)) else base
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=LM + f"({'|'.join(modules)})",
                        **extra)
    peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=g) * b_std)
    peft_model.save_pretrained(str(out))
    peft_model.unload()  # the LoRA layers out again: the base model is reusable
    return Path(out)


def make_head(directory: str | Path, type_: str, hidden: int, seed: int, **kw) -> Path:
    """A random head with a non-trivial pooling query, saved as head.safetensors + head.json in `directory`."""
    if type_ == "classify":
        kw.setdefault("labels", ["car", "bus", "truck", "bike"])
    torch.manual_seed(seed)
    head = build_head(HeadConfig(type=type_, hidden_size=hidden, max_count=5, max_boxes=3, **kw))
    with torch.no_grad():
        if hasattr(head, "query"):
            head.query.normal_(0, 2.0)
        head.proj.weight.normal_(0, 1.0)
    save_head(head, directory)
    return Path(directory)


def make_classifier_adapter(base: str | Path, out: str | Path) -> Path:
    """An adapter on q/v/down with a mean-pooled classify head whose projection is scaled by 0.1, so its
    probabilities stay unsaturated and a confidence check compares something."""
    from zoo import load_pretrained

    from heads import load_head

    model = load_pretrained(base)[0]
    path = make_adapter(model, out, ["q_proj", "v_proj", "down_proj"], 8, 16, seed=3)
    make_head(path, "classify", model.config.get_text_config().hidden_size, seed=4, pooling="mean")
    head = load_head(path)
    with torch.no_grad():
        head.proj.weight *= 0.1
    save_head(head, path)
    return path


def write_meta(adapter: str | Path, domains: dict[str, str]) -> None:
    """meta.json naming each domain's task, as the trainer writes it."""
    meta = {"name": Path(adapter).name, "tasks": sorted(set(domains.values())),
            "domains": {d: {"task": t, "head": f"heads/{d}"} for d, t in domains.items()}}
    (Path(adapter) / "meta.json").write_text(json.dumps(meta))


def build_adapters(base: str | Path, root: Path, names=tuple(ADAPTERS)) -> dict[str, Path]:
    from zoo import load_pretrained

    model = load_pretrained(base)[0]
    out = {}
    for i, name in enumerate(names):
        modules, r, alpha, extra = ADAPTERS[name]
        out[name] = make_adapter(model, root / name, modules, r, alpha, seed=11 * (i + 1), **extra)
    return out


@functools.lru_cache(maxsize=None)
def peft_model(base: str, adapters: tuple[tuple[str, str], ...]):
    """(PeftModel holding every adapter, processor) over a fresh copy of the base model."""
    from peft import PeftModel

    from zoo import load_pretrained

    model, processor = load_pretrained(base)
    (first, path), rest = adapters[0], adapters[1:]
    model = PeftModel.from_pretrained(model, path, adapter_name=first)
    for name, p in rest:
        model.load_adapter(p, adapter_name=name)
    return model.eval(), processor


def peft_generate(model, processor, spec: dict, adapter: str | None, max_new: int = MAX_NEW):
    """Greedy tokens and per-step logits of one request through PEFT with adapter_names=[adapter]."""
    inputs = hf_inputs(processor, spec)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, adapter_names=[adapter or "__base__"])
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [step[0].float() for step in out.logits][:len(tokens)]


def peft_hidden(model, processor, spec: dict, adapter: str) -> torch.Tensor:
    """Final hidden states [P, D] of the prompt (after the final norm) with the adapter applied."""
    inputs = hf_inputs(processor, spec)
    with torch.no_grad():
        out = model(**inputs, adapter_names=[adapter], output_hidden_states=True)
    return out.hidden_states[-1][0]
