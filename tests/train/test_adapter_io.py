"""The adapter directory: PEFT loads what we save and computes the same outputs, heads round-trip,
meta.json says what the adapter holds; and the fusion trainer treats states as values."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from train_fixtures import tiny_domain

from adapters.base import fingerprint
from fusion import Domain, export_adapters, fuse, read_manifest
from train import (AdapterState, HeadState, LoraSpec, LoraTrainer, ModelRef, TrainConfig, VisionLM, collate,
                   load_adapter, load_domain, read_meta, save_adapter, train_adapter)
from train.evaluate import hidden_states
from train.model import lm_head_of

QUIET = open(os.devnull, "w")


@pytest.fixture(scope="module")
def trained(tiny_zoo, vlora_home):
    """A LoRA trained a few steps on one domain (so B != 0), with its head."""
    vlm = VisionLM(ModelRef("qwen2_vl_tiny", str(tiny_zoo["qwen2_vl_tiny"])), LoraSpec(rank=4, alpha=8), device="cpu")
    data = load_domain(tiny_domain(vlora_home, "count_vehicles", tiny_zoo["qwen2_vl_tiny"], limit=12))
    result = train_adapter(vlm, data, TrainConfig(epochs=1, batch_size=4, lr=5e-3), log=QUIET)
    state = AdapterState(result.lora, {data.name: HeadState.of(result.head)},
                         {data.name: {"task": "count", "labels": None}}, {data.name: result.metrics})
    return vlm, data, state


def test_adapter_loads_in_plain_peft_with_identical_outputs(trained, tiny_zoo, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    vlm, data, state = trained
    path = save_adapter(vlm, state, tmp_path / "count")
    assert any(v.abs().sum() > 0 for k, v in state.lora.items() if "lora_B" in k), "the LoRA must be non-trivial"
    row = data.splits["eval"][0]
    item = vlm.encoder.encode(row, data.info)
    hidden, mask = hidden_states(vlm, [item])
    ours = lm_head_of(vlm.model)(hidden)  # [1, T, V]

    base = AutoModelForImageTextToText.from_pretrained(str(tiny_zoo["qwen2_vl_tiny"]), local_files_only=True)
    peft_model = PeftModel.from_pretrained(base, str(path)).eval()
    inputs = vlm.processor(text=[row["prompt"]], images=[row["image"].convert("RGB")], return_tensors="pt")
    with torch.no_grad():
        theirs = peft_model(**inputs).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    with peft_model.disable_adapter(), torch.no_grad():
        plain = peft_model(**inputs).logits
    assert not torch.allclose(plain, theirs, atol=1e-4), "the adapter changes the outputs"


def test_adapter_directory_layout_meta_and_head_round_trip(trained, tmp_path):
    vlm, data, state = trained
    path = save_adapter(vlm, state, tmp_path / "count")
    names = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert {"adapter_config.json", "adapter_model.safetensors", "meta.json",
            f"heads/{data.name}/head.safetensors", f"heads/{data.name}/head.json"} <= names
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    meta = read_meta(path)
    assert meta["tasks"] == ["count"] and meta["order"] == [data.name]
    assert meta["base_model"] == {"name": "qwen2_vl_tiny", "path": str(Path(vlm.ref.path).resolve()), "arch": "qwen2_vl",
                                  "fingerprint": fingerprint(vlm.ref.path)}  # the server checks it
    assert meta["base_model"]["fingerprint"].startswith("sha256:")
    assert meta["lora"]["rank"] == 4 and meta["lora"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    dom = meta["domains"][data.name]
    assert dom["head"] == f"heads/{data.name}" and dom["accuracy"] == state.accuracies[data.name]["accuracy"]
    assert dom["metric"] == "top1"

    back = load_adapter(path)
    assert back.lora.keys() == state.lora.keys()
    assert all(torch.equal(back.lora[k], v) for k, v in state.lora.items())
    item = vlm.encoder.encode(data.splits["eval"][0], data.info)
    hidden, mask = hidden_states(vlm, [item])
    original, loaded = state.heads[data.name].build(), back.heads[data.name].build()
    for a, b in zip(original(hidden, mask).values(), loaded(hidden, mask).values()):
        assert torch.equal(a, b)
    assert back.accuracies == {data.name: {k: state.accuracies[data.name][k]
                                           for k in ("accuracy", "metric", "n", "baseline", "baselines")}}
    assert isinstance(back.accuracies[data.name]["baseline"]["answer"], int), "the majority count rides along"


def test_fusion_trainer_returns_new_states_and_fuses(tiny_zoo, vlora_home, tmp_path):
    vlm = VisionLM(ModelRef("qwen2_vl_tiny", str(tiny_zoo["qwen2_vl_tiny"])), LoraSpec(rank=4, alpha=8), device="cpu")
    for name in ("exists_bus", "color_largest"):
        tiny_domain(vlora_home, name, tiny_zoo["qwen2_vl_tiny"], limit=12)
    trainer = LoraTrainer(vlm, vlora_home / "datasets", TrainConfig(epochs=1, batch_size=4, lr=5e-3), log=QUIET)
    first = trainer.train(trainer.new_adapter(0), Domain("exists_bus", "binary", 0.0))
    before = {k: v.clone() for k, v in first.lora.items()}
    head_before = {k: v.clone() for k, v in first.heads["exists_bus"].weights.items()}
    second = trainer.train(first, Domain("color_largest", "classify", 0.0))
    assert all(torch.equal(first.lora[k], v) for k, v in before.items()), "train must not touch its argument"
    assert all(torch.equal(first.heads["exists_bus"].weights[k], v) for k, v in head_before.items())
    assert list(first.heads) == ["exists_bus"] and list(second.heads) == ["exists_bus", "color_largest"]
    assert any(not torch.equal(second.lora[k], v) for k, v in before.items()), "the LoRA kept training"
    assert all(torch.equal(second.heads["exists_bus"].weights[k], v) for k, v in head_before.items()), \
        "earlier heads stay as they were"
    acc = trainer.evaluate(second, Domain("exists_bus", "binary", 0.0))
    assert 0.0 <= acc <= 1.0 and second.accuracies["exists_bus"]["accuracy"] == acc
    with pytest.raises(ValueError, match="declared with task"):
        trainer.train(first, Domain("color_largest", "count", 0.0))

    # The real trainer plugs into fusion unchanged; requirements of 0 make one adapter of both
    # (accepted at their majority baselines: one epoch on 9 items beats no baseline on 3 eval items).
    domains = [Domain("exists_bus", "binary", 0.0, 9), Domain("color_largest", "classify", 0.0, 9)]
    result = fuse(domains, trainer, order="given", workdir=tmp_path / "work", refuse_at_baseline=False)
    assert result.num_adapters == 1 and result.adapters[0].domains == ["exists_bus", "color_largest"]
    manifest = read_manifest(export_adapters(result, trainer, tmp_path / "fused"))
    assert manifest["tasks"]["color_largest"]["head"] == "color_largest"
    meta = read_meta(tmp_path / "fused" / "fused_0")
    assert meta["order"] == ["exists_bus", "color_largest"] and set(meta["tasks"]) == {"binary", "classify"}
    assert all(meta["domains"][d]["accuracy"] is not None for d in meta["order"])
    reloaded = trainer.load(str(tmp_path / "fused" / "fused_0"))
    reloaded.accuracies.clear()  # evaluate the weights again rather than the memo
    assert trainer.evaluate(reloaded, domains[1]) == pytest.approx(result.adapters[0].accuracies["color_largest"])


def test_collate_pads_right_and_masks_answers(trained):
    vlm, data, _ = trained
    rows = [data.splits["train"][i] for i in range(2)]
    items = [vlm.encoder.encode(r, data.info) for r in rows]
    answers = [vlm.encoder.answer_ids("3"), vlm.encoder.answer_ids("12")]
    batch = collate(items, vlm.encoder.pad_id, answers)
    lengths = [it.input_ids.numel() + a.numel() for it, a in zip(items, answers)]
    assert batch["attention_mask"].sum(1).tolist() == lengths
    for i, (it, a) in enumerate(zip(items, answers)):
        n0 = it.input_ids.numel()
        assert (batch["labels"][i, :n0] == -100).all() and torch.equal(batch["labels"][i, n0:lengths[i]], a)
    assert batch["visual"].shape[0] == int(batch["visual_mask"].sum())


@pytest.mark.parametrize("model,domain", [("qwen2_vl_tiny", "color_largest"), ("qwen2_vl_tiny", "direction"),
                                          ("qwen2_5_vl_tiny", "direction"), ("llava_1_5_tiny", "color_largest")])
def test_split_forward_with_cached_vision_matches_the_model(model, domain, tiny_zoo, vlora_home):
    """Cached vision features scattered into the embeddings, M-RoPE positions computed once per
    item, padded batches: the same logits as the model's own forward on the processor's inputs."""
    vlm = VisionLM(ModelRef(model, str(tiny_zoo[model])), LoraSpec(rank=4, alpha=8), device="cpu")
    data = load_domain(tiny_domain(vlora_home, domain, tiny_zoo["qwen2_vl_tiny"], limit=12))
    rows = [data.splits["train"][i] for i in range(3)]
    hidden, mask = hidden_states(vlm, [vlm.encoder.encode(r, data.info) for r in rows])  # right-padded batch
    ours = lm_head_of(vlm.model)(hidden)
    kind = "videos" if data.info.media == "clip" else "images"
    for i, row in enumerate(rows):
        prompt = vlm.encoder.render_prompt(row["question"], row["media"])
        inputs = vlm.processor(text=[prompt], return_tensors="pt", **{kind: [vlm.encoder._media(row)]})
        with torch.no_grad():
            theirs = vlm.model(**inputs).logits[0]  # PEFT model, fresh LoRA (B = 0)
        n = int(mask[i].sum())
        assert n == theirs.shape[0]
        torch.testing.assert_close(ours[i, :n], theirs, rtol=1e-4, atol=1e-4)


def test_the_probes_load_an_adapter_on_its_base_with_and_without_its_lora(trained, tiny_zoo, tmp_path):
    from vlora.commands.diagnose import adapter_on_base

    vlm, data, state = trained
    path = save_adapter(vlm, state, tmp_path / "count")
    vlm.model.eval()
    item = vlm.encoder.encode(data.splits["eval"][0], data.info)
    with_lora, loaded = adapter_on_base(path)
    without, _ = adapter_on_base(path, lora=False)
    plain = VisionLM(ModelRef("qwen2_vl_tiny", str(tiny_zoo["qwen2_vl_tiny"])), LoraSpec(rank=4, alpha=8), device="cpu")
    plain.model.eval()
    assert set(loaded.heads) == {data.name}
    torch.testing.assert_close(hidden_states(with_lora, [item])[0], hidden_states(vlm, [item])[0])
    torch.testing.assert_close(hidden_states(without, [item])[0], hidden_states(plain, [item])[0])
    assert not torch.allclose(hidden_states(without, [item])[0], hidden_states(vlm, [item])[0]), \
        "without its LoRA the adapter's base answers differently"
