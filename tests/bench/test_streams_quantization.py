"""`bench.streams.quantization`: the job's field reaches the engine (FP8 projections under the test-only
CPU allowance), is refused on the CPU in one line before any model is built, and sits in the config."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from bench.engine import build_random_model
from bench.streams import StreamsBenchJob, _engine, run_streams_bench
from serve.models import fp8 as fp8_models
from vlora.config import compose

TINY = dict(model="qwen2_vl_tiny", device="cpu", image_size=56, adapters=1, engine_warm_up=False,
            hf_baseline=False, fresh_caches=False, max_batch_size=4, max_tokens_per_step=512)


@pytest.mark.parametrize("quantization, message", [("fp8", "needs a GPU with FP8 tensor cores"),
                                                   ("int4", "is not one of")])
def test_streams_refuses_a_quantization_the_device_cannot_serve_before_building(quantization, message, capsys):
    with pytest.raises(ValueError, match=message) as err:
        run_streams_bench(StreamsBenchJob(quantization=quantization, **TINY))
    assert "\n" not in str(err.value) and "building" not in capsys.readouterr().err  # no model was built


def test_streams_engine_gets_the_jobs_quantization(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        workdir = Path(tempfile.mkdtemp(prefix="streams-q-"))
        hf, _ = build_random_model("qwen2_vl_tiny", 0, "float32", "cpu", workdir)
        monkeypatch.setattr(fp8_models, "ALLOW_CPU", True)  # the engine's own refusal is the test above
        engine, names = _engine(StreamsBenchJob(quantization="fp8", **TINY), workdir, hf, 64)
        assert engine.config.quantization == "fp8" and names == ["a0"]
        kinds = {type(m.base if hasattr(m, "base") else m).__name__ for _, _, m in engine.model.language_model.projections()}
        assert kinds == {"Fp8Linear"}
        del engine
        plain, _ = _engine(StreamsBenchJob(**TINY), workdir, hf, 64)
        assert plain.config.quantization == "none"
        assert {type(m.base if hasattr(m, "base") else m).__name__
                for _, _, m in plain.model.language_model.projections()} == {"Linear"}
    finally:
        torch.set_num_threads(threads)


def test_streams_config_has_quantization_none():
    assert compose("bench", []).bench.streams.quantization == "none"
