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

# Tests that start process trees of their own (Ray clusters, tensor-parallel groups of gloo ranks). When the
# tests run in several workers (pytest-xdist, `--dist loadgroup`), these run in one of them, one after another:
# two Ray clusters at once on two cores starve each other's start-up deadlines.
PROCESS_TREES = (
    "tests/bench/test_bench_tp.py", "tests/bench/test_scaling_bench.py", "tests/bench/test_scaling_streams.py",
    "tests/bench/test_scaling_streams_tp.py", "tests/serve/distributed/", "tests/serve/models/test_fp8_linear.py",
    "tests/serve/models/test_shard_at_load.py",
)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    trees = pytest.mark.xdist_group("process_trees")
    for item in items:
        if item.nodeid.startswith(PROCESS_TREES):
            item.add_marker(trees)
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
