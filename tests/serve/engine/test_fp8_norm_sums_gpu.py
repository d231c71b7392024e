"""GPU only: o_proj and down_proj leaving their split decode GEMM's sums to the fused norm after them
(serve/models/fp8.py NORM_SUMS) changes no logit. qwen2_vl_small's down_proj splits K at decode; the bench's
accuracy rows run it without an adapter, unmerged (the LoRA wrapper sums before it adds) and merged."""

from __future__ import annotations

import pytest
import torch

from serve.models import fp8 as fp8_models

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU")]


def test_sums_left_to_the_norm_give_the_logits_of_the_reduction(tmp_path, monkeypatch):
    from bench.fp8 import Fp8BenchJob, run_fp8_bench
    from vlora_kernels import fp8_decode

    assert fp8_decode.decode_config(512, 2048)[2] > 1  # down_proj's [hidden, intermediate] weight: split over K
    errors = {}
    for on in (True, False):
        monkeypatch.setattr(fp8_models, "NORM_SUMS", on)
        rows, _ = run_fp8_bench(Fp8BenchJob(model="qwen2_vl_small", device="cuda", prompts=2, prompt_tokens=16,
                                            image_size=56, output_tokens=6, batch_sizes=(4,), decode_tokens=3,
                                            switch_repeats=1, gemm=False, out_dir=str(tmp_path / str(on))))
        errors[on] = {(r["precision"], r["adapter"], r["mode"]): (r["logit_mean_abs_err"], r["logit_max_abs_err"],
                                                                  r["token_agreement"])
                      for r in rows if r["section"] == "accuracy" and r["against"] == "fp32"}
    assert errors[True] == errors[False]
    assert {mode for p, a, mode in errors[True] if p == "fp8"} >= {"unmerged", "merged"}
