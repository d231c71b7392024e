"""The mode tests' checkpoint and adapters (tiny Qwen2-VL, fp32), shared by the tests of the modes
(serve/lora) and of the orchestrated engine (serve/engine)."""

from __future__ import annotations

import pytest
from adapter_cases import build_adapters

from serve import Engine, EngineConfig

ADAPTERS = ("qv8", "all16", "mix")


@pytest.fixture(scope="module")
def setup(vlora_home, tmp_path_factory):
    from zoo import build_checkpoint

    ckpt = build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")
    adapters = build_adapters(ckpt, tmp_path_factory.mktemp("mode_adapters"), ADAPTERS)
    return ckpt, adapters


def make_engine(setup, **kw) -> Engine:
    ckpt, adapters = setup
    config = EngineConfig(device="cpu", dtype="float32", enable_prefix_cache=False, adapter_slots=4,
                          max_lora_rank=16, adapters=tuple(f"{n}={p}" for n, p in adapters.items()), **kw)
    return Engine(ckpt, config)
