"""The base model's identity travels with an adapter: the fingerprint tells apart checkpoints of
the same shapes, survives a copy, and the engine refuses an adapter recorded for another base."""

from __future__ import annotations

import shutil

import pytest
from adapter_cases import make_adapter
from base_cases import other_base, train_adapter

import adapters.base as base_mod
from adapters import base_identity, check_base, fingerprint, same_base
from serve.engine import Engine, EngineConfig
from serve.lora.loader import AdapterLoadError

NAME = "qwen2_vl_tiny"


@pytest.fixture(scope="module")
def bases(tiny_zoo, tmp_path_factory):
    return tiny_zoo[NAME], other_base(tmp_path_factory.mktemp("bases"))


def test_fingerprint_tells_same_shaped_checkpoints_apart_and_survives_a_copy(bases, tmp_path, monkeypatch):
    a, b = bases
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    copy = shutil.copytree(a, tmp_path / "moved")
    assert fingerprint(a) != fingerprint(b) and fingerprint(a) == fingerprint(copy)
    monkeypatch.setattr(base_mod, "FULL_HASH_BYTES", 1024)  # the sampled path of multi-GB files
    assert fingerprint(a) != fingerprint(b) and fingerprint(a) == fingerprint(copy)
    assert same_base(base_identity(a), base_identity(copy)) is True  # moved: same weights
    assert same_base(base_identity(a), base_identity(b)) is False
    assert same_base(base_identity(a), None) is None and fingerprint(tmp_path / "nothing") is None
    with pytest.raises(ValueError, match=f"{b}.*but the model is {NAME}.*{a}"):
        check_base(base_identity(b), base_identity(a, NAME), "adapter 'x'")


def test_the_engine_refuses_an_adapter_recorded_for_another_base(bases, tmp_path):
    a, b = bases
    on_b = train_adapter(b, tmp_path / "on_b", {"exists_bus": ("binary", 0.9)})
    on_a = train_adapter(a, tmp_path / "on_a", {"exists_bus": ("binary", 0.9)})
    elsewhere = make_adapter(a, tmp_path / "peft_only", ["q_proj"], 4, 8, seed=2)  # no meta.json
    engine = Engine(a, EngineConfig(device="cpu", num_kv_blocks=16, adapter_slots=2))
    with pytest.raises(AdapterLoadError, match=f"trained on base model {b.name} \\({b}.*the model is .*\\({a}"):
        engine.load_adapter("on_b", on_b)
    assert engine.list_adapters() == []
    engine.load_adapter("on_a", on_a)
    engine.load_adapter("peft_only", elsewhere)  # trained elsewhere: nothing to check
    engine.load_adapter("on_b", on_b, allow_base_mismatch=True)
    assert [x["name"] for x in engine.list_adapters()] == ["on_a", "peft_only", "on_b"]
