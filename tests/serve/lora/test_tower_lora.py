"""LoRA on the vision tower served: the engine against transformers + PEFT (fp32, tiny zoo), and the
encoder cache keeping each tower-adapting adapter's outputs its own.

The tower adapter is what `train.train_vision_tower=true` makes (train.model.target_regex: the
language model's q/v and every tower linear, Qwen's patch-embedding convolution among them), with
lora_B randomised. The oracle runs each request alone through PEFT with that adapter active
(PEFT's `adapter_names=` splits rows by batch index, which a packed tower pass does not have)."""

from __future__ import annotations

import pytest
import torch
from adapter_cases import make_adapter
from adapter_cases import one_thread  # noqa: F401 (autouse: one intra-op thread here)
from serve_cases import assert_matches_hf, frames, hf_inputs, image, make_request

from serve import Engine, EngineConfig
from serve.lora import AdapterLoadError

MAX_NEW = 3
ARCHS = {"qwen2_vl_tiny": "qwen2_vl", "qwen2_5_vl_tiny": "qwen2_5_vl", "llava_1_5_tiny": "llava"}
_REFS: dict = {}


def make_tower_adapter(base_model, arch: str, out, seed: int, rank: int = 8):
    """A PEFT directory as `train_vision_tower` writes it (tower and language model), B randomised."""
    from peft import LoraConfig, get_peft_model

    from train.model import LoraSpec, target_regex

    torch.manual_seed(seed)
    regex = target_regex(arch, LoraSpec(rank=rank, alpha=2 * rank, target_modules=["q_proj", "v_proj"]), True)
    model = get_peft_model(base_model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                  target_modules=regex))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.15)
    model.save_pretrained(str(out))
    model.unload()
    return out


@pytest.fixture(scope="module")
def tower_adapters(tiny_zoo, tmp_path_factory):
    """name -> {"tower": dir, "tower2": dir, "lm": dir} per tiny model."""
    from zoo import load_pretrained

    root = tmp_path_factory.mktemp("tower_adapters")
    out = {}
    for name, arch in ARCHS.items():
        model = load_pretrained(tiny_zoo[name])[0]
        out[name] = {"tower": make_tower_adapter(model, arch, root / name / "tower", seed=5),
                     "tower2": make_tower_adapter(model, arch, root / name / "tower2", seed=9),
                     "lm": make_adapter(model, root / name / "lm", ["q_proj", "v_proj"], 8, 16, seed=3)}
    return out


def _specs(arch: str) -> list[tuple[dict, str | None]]:
    """The same picture under the tower adapter, an LM-only adapter and none, and a video (Qwen)."""
    picture = dict(prompt="How many cars?", images=[image(0, 56, 84)])
    specs = [(picture, "tower"), (picture, "lm"), (picture, None)]
    if arch != "llava":
        specs.append((dict(prompt="Which way?", video=frames(3, n=4, side=56)), "tower"))
    return specs


def _reference(name, tiny_zoo, adapters, spec, adapter):
    key = (name, spec["prompt"], adapter)
    if key not in _REFS:
        from peft import PeftModel

        from zoo import load_pretrained

        if name not in _REFS:
            model, processor = load_pretrained(tiny_zoo[name])
            model = PeftModel.from_pretrained(model, str(adapters[name]["tower"]), adapter_name="tower")
            for other in ("tower2", "lm"):
                model.load_adapter(str(adapters[name][other]), adapter_name=other)
            _REFS[name] = (model.eval(), processor)
        model, processor = _REFS[name]
        inputs = hf_inputs(processor, spec)
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, output_logits=True,
                                         return_dict_in_generate=True)
            else:
                model.set_adapter(adapter)
                out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
        tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        _REFS[key] = (tokens, [step[0].float() for step in out.logits][:len(tokens)])
    return _REFS[key]


def _engine(name, tiny_zoo, adapters, **config) -> Engine:
    engine = Engine(tiny_zoo[name], EngineConfig(device="cpu", num_kv_blocks=64, adapter_slots=3, max_lora_rank=16,
                                                 **config))
    for adapter, path in adapters[name].items():
        engine.load_adapter(adapter, path)
    return engine


def _request(spec, adapter):
    request = make_request(spec, MAX_NEW)
    request.adapter = adapter
    return request


@pytest.mark.parametrize("name", list(ARCHS))
def test_tower_and_lm_adapters_in_one_step_match_peft(name, tiny_zoo, tower_adapters):
    # one step's packed tower pass holds the picture under the tower adapter and (image-only key)
    # under the others, and the video clip's frame groups under the tower adapter
    engine = _engine(name, tiny_zoo, tower_adapters)
    assert engine.lora.adapts_tower("tower") and not engine.lora.adapts_tower("lm")
    specs = _specs(ARCHS[name])
    outputs = engine.generate([_request(spec, adapter) for spec, adapter in specs])
    assert_matches_hf(outputs, [_reference(name, tiny_zoo, tower_adapters, s, a) for s, a in specs])
    # the tower adapter acts beyond its language-model half: its picture's answer differs from "lm"'s
    assert (outputs[0].logits[0] - outputs[1].logits[0]).abs().max() > 1e-2
    assert engine.runner.counters["encoder_calls"] == 1  # every item of the step in one tower pass


@pytest.mark.parametrize("name", ["qwen2_5_vl_tiny"])
def test_the_encoder_cache_never_serves_one_adapters_tower_output_to_another(name, tiny_zoo, tower_adapters):
    # one request at a time, so every later one could take the cached tower output of an earlier one
    # (no prefix cache: a repeated prompt would skip the tower altogether)
    engine = _engine(name, tiny_zoo, tower_adapters, enable_prefix_cache=False)
    picture = _specs(ARCHS[name])[0][0]
    order = ["tower", None, "tower2", "lm", "tower", None]
    outputs = [engine.generate([_request(picture, adapter)])[0] for adapter in order]
    assert_matches_hf(outputs, [_reference(name, tiny_zoo, tower_adapters, picture, a) for a in order])
    # encoded: tower, base (then shared by "lm"), tower2; the second tower and base requests hit
    assert engine.runner.counters["items_encoded"] == 3
    assert engine.stats().encoder_cache_hits == 3 and engine.stats().encoder_cache_size == 3
    # a reload under the same name is a new adapter: its requests never take the old one's outputs
    engine.unload_adapter("tower")
    engine.load_adapter("tower", tower_adapters[name]["tower2"])
    again = engine.generate([_request(picture, "tower")])[0]
    assert again.token_ids == outputs[2].token_ids
    assert engine.runner.counters["items_encoded"] == 4


def test_an_adapter_of_the_merger_is_refused_and_the_tower_can_be_left_unserved(tiny_zoo, tower_adapters, tmp_path):
    from peft import LoraConfig, get_peft_model

    from zoo import load_pretrained

    name = "qwen2_vl_tiny"
    model = get_peft_model(load_pretrained(tiny_zoo[name])[0], LoraConfig(r=4, target_modules=r".*merger\.mlp\.0"))
    model.save_pretrained(str(tmp_path / "merger"))
    engine = _engine(name, tiny_zoo, {name: {}})
    with pytest.raises(AdapterLoadError, match=r"does not apply LoRA to.*vision tower's \['attn.proj', 'attn.qkv'"):
        engine.load_adapter("merger", tmp_path / "merger")
    from serve.lora import AdapterManager, PoolConfig

    plain = AdapterManager(engine.model, PoolConfig(slots=2, max_rank=16, tower=False), torch.float32,
                           torch.device("cpu"))
    with pytest.raises(AdapterLoadError, match="this model's tower takes no LoRA"):
        plain.load("tower", tower_adapters[name]["tower"])
    # the engine's switch (engine.tower_lora in conf/serve.yaml): no tower slots, such adapters refused
    off = Engine(tiny_zoo[name], EngineConfig(device="cpu", num_kv_blocks=32, adapter_slots=2, max_lora_rank=16,
                                              tower_lora=False))
    assert not any(kind.startswith("tower.") for kind in off.lora.pool.kinds)
    with pytest.raises(AdapterLoadError, match="this model's tower takes no LoRA"):
        off.load_adapter("tower", tower_adapters[name]["tower"])



def test_the_tower_through_the_triton_interpreter_computes_what_the_torch_op_computes(tiny_zoo, tower_adapters):
    if torch.cuda.is_available():  # the CPU engine's Triton kernels run only under the interpreter (CPU hosts)
        pytest.skip("CPU hosts only; tests/serve/lora/test_tower_lora_gpu.py runs the kernels on a GPU")
    from serve.lora.metadata import OPS

    # bf16 so the ATMM kernels run; one pass holds a picture under "tower", the same under "tower2" and a
    # picture of no adapter (Qwen2.5-VL: window order, and the patch embedding's K = 1176)
    name = "qwen2_5_vl_tiny"
    engine = _engine(name, tiny_zoo, tower_adapters, dtype="bfloat16", lora_backend="triton")
    tower = engine.lora.tower
    assert tower.op is OPS["triton"]
    items = [it for im in (image(0, 56, 84), image(0, 56, 84), image(4, 84, 56))
             for it in engine.processor.process("x", None, [im]).vision]
    items[1].content_hash += "|other"  # the same pixels under a second adapter
    slots = {}
    for adapter, item in zip(("tower", "tower2"), items):
        assert engine.lora.ready(adapter)
        slots[item.content_hash] = engine.lora.slot_of(adapter)
    outs = {}
    for op in ("triton", "torch"):
        tower.op = OPS[op]
        with tower.step(slots):
            outs[op] = [e.float() for e in engine.model.encode(items)]
    plain = [e.float() for e in engine.model.encode(items)]  # outside a step: no LoRA
    for got, want in zip(outs["triton"], outs["torch"]):
        assert (got - want).abs().max() < 0.05 * want.abs().max()  # bf16 roundings in different orders
    assert (outs["torch"][0] - outs["torch"][1]).abs().max() > 0.1  # two adapters, two outputs
    assert (outs["torch"][0] - plain[0]).abs().max() > 0.1
    assert torch.equal(outs["triton"][2], plain[2])  # the item of no adapter is untouched
