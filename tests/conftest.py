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


class _Alone:
    """Tests marked `alone` run with no other test in progress when the tests run in several workers:
    each worker holds a shared lock on one file while a test of its runs, an `alone` test an exclusive
    one. A turnstile file taken before either lets an `alone` test waiting for the exclusive lock stop
    the other worker from starting its next test (a shared lock is granted while an exclusive one waits)."""

    def __init__(self, run_id: str):
        import tempfile

        stem = os.path.join(tempfile.gettempdir(), f"vlora-tests-{run_id}")
        self.turnstile, self.room = open(stem + ".turnstile", "a+"), open(stem + ".room", "a+")

    def enter(self, alone: bool) -> None:
        import fcntl

        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        fcntl.flock(self.room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def leave(self) -> None:
        import fcntl

        fcntl.flock(self.room, fcntl.LOCK_UN)

    def close(self) -> None:  # each worker holds its own descriptors: the files can go whichever ends first
        for f in (self.turnstile, self.room):
            f.close()
            try:
                os.unlink(f.name)
            except OSError:
                pass


def pytest_configure(config):
    worker = getattr(config, "workerinput", None)  # set in a pytest-xdist worker only
    config._vlora_alone = _Alone(worker["testrunuid"]) if worker else None


def pytest_unconfigure(config):
    if getattr(config, "_vlora_alone", None) is not None:
        config._vlora_alone.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    alone = item.config._vlora_alone
    if alone is None:
        yield
        return
    alone.enter(item.get_closest_marker("alone") is not None)
    try:
        yield
    finally:
        alone.leave()


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
