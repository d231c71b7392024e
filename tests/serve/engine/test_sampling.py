"""Sampling (greedy, temperature, top-k, top-p, per-request generators) and incremental detokenisation."""

from __future__ import annotations

import pytest
import torch

from serve import SamplingParams
from serve.engine.detokenizer import IncrementalDetokenizer
from serve.engine.sampling import apply_top_k_top_p, sample


def test_top_k_and_top_p_keep_the_right_sets():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    kept = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 0.65]))
    assert torch.isfinite(kept).tolist() == [[True, True, False, False], [False, False, True, True]]
    kept = apply_top_k_top_p(logits, torch.tensor([0, 0]), torch.tensor([0.01, 0.01]))
    assert torch.isfinite(kept).sum(-1).tolist() == [1, 1]  # the top token always stays


def test_greedy_rows_take_the_argmax_and_sampled_rows_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = torch.log(probs).expand(4000, -1).clone()
    params = [SamplingParams(temperature=1.0)] * 3999 + [SamplingParams()]
    gen = torch.Generator().manual_seed(0)
    tokens = sample(logits, params, [None] * 4000, gen)
    freq = torch.bincount(tokens[:-1], minlength=4).float() / 3999
    assert torch.allclose(freq, probs, atol=0.03) and tokens[-1] == 0
    hot = sample(logits[:2000], [SamplingParams(temperature=1.0, top_k=1)] * 2000, [None] * 2000, gen)
    assert (hot == 0).all()
    cold = sample(logits[:2000] / 0.05, [SamplingParams(temperature=0.05)] * 2000, [None] * 2000, gen)
    assert (cold == 0).float().mean() > 0.99


def test_a_seeded_row_draws_the_same_tokens_whatever_its_neighbours():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=g)
    params = [SamplingParams(temperature=1.0, seed=7)] + [SamplingParams(temperature=1.0)] * 5
    draws = []
    for neighbours, default_seed in ((logits[1:], 0), (torch.randn(5, 50, generator=g), 1)):
        gens = [torch.Generator().manual_seed(7)] + [None] * 5
        batch = torch.cat([logits[:1], neighbours])
        default = torch.Generator().manual_seed(default_seed)
        draws.append([sample(batch, params, gens, default)[0].item() for _ in range(8)])
    alone = torch.Generator().manual_seed(7)
    assert draws[0] == draws[1] == [sample(logits[:1], params[:1], [alone])[0].item() for _ in range(8)]
    assert len(set(draws[0])) > 1  # it really samples


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_incremental_detokenisation_equals_decoding_the_whole_output(tiny_zoo):
    from transformers import AutoTokenizer

    for name in ("qwen2_vl_tiny", "llava_1_5_tiny"):
        tok = AutoTokenizer.from_pretrained(tiny_zoo[name])
        text = "Ünïcödé → 東京 🚗 two red cars,\n then  spaces"
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.add([i]) for i in ids] + [detok.flush()]
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == detok.text
        assert all("\ufffd" not in d for d in deltas)  # split characters are held back, not emitted broken
