"""Shared fixtures: an isolated VLORA_HOME per session and the tiny zoo built once."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests must never reach a model hub
if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on CPU; it must be chosen before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_MODELS = ("qwen2_vl_tiny", "qwen2_5_vl_tiny", "llava_1_5_tiny")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vlora_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("vlora_home")
    old = os.environ.get("VLORA_HOME")
    os.environ["VLORA_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("VLORA_HOME", None)
    else:
        os.environ["VLORA_HOME"] = old


@pytest.fixture(scope="session")
def tiny_zoo(vlora_home):
    """name -> checkpoint directory of every tiny zoo model, built once per test session."""
    from zoo import build_checkpoint

    return {name: build_checkpoint(name, vlora_home / "zoo" / name) for name in TINY_MODELS}
