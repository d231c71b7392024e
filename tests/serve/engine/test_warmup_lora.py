"""The warm-up's sweep of the LoRA kernels (serve/engine/warmup_lora.py): every kernel variant a live
step can need is among the swept ones, for the 7B shape and the committed H100 / H200 tables; the
sweep runs the real operator (the Triton interpreter on CPU) and changes neither the pool nor the
weights nor an answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from adapter_cases import make_adapter

from vlora_kernels import TilingTable, build_segments
from vlora_kernels.table import TABLE_DIR
from serve import Engine, EngineConfig
from serve.engine import Request, SamplingParams
from serve.engine.warmup_lora import block_ms, layouts, sweep_batches, sweep_lora_kernels, variant

QKV_7B, O_7B = (3584, 512, 512), (3584,)  # Qwen2-VL-7B: 28 query heads and 4 key/value heads of 128


def _pool(slices: tuple[int, ...], slots: int, rank: int = 64, k: int = 3584) -> torch.Tensor:
    return torch.empty(len(slices), slots, rank, k, device="meta")  # only its shape is read


def _live_batch(rng: np.random.Generator, max_tokens: int, slots: int) -> tuple[list[int], int | None]:
    """A step as live traffic makes one: any token count, any number of adapters with any split of the
    tokens between them and the base model, merged adapter or not."""
    total = int(rng.integers(1, max_tokens + 1))
    mix = int(rng.integers(0, slots)) if rng.random() < 0.4 else None
    free = [s for s in range(slots) if s != mix]
    g = int(rng.integers(1, min(len(free), total) + 1))
    lora_tokens = int(rng.integers(g, total + 1))
    cuts = np.sort(rng.choice(np.arange(1, lora_tokens), g - 1, replace=False)) if g > 1 else np.array([], int)
    lens = np.diff(np.concatenate([[0], cuts, [lora_tokens]]))
    chosen = rng.choice(free, g, replace=False)
    ids = [int(s) for s, n in zip(chosen, lens) for _ in range(n)] + [-1] * (total - lora_tokens)
    return list(rng.permutation(ids)), mix


def _swept(pool, slices, table, max_tokens: int, slots: int) -> set:
    metas = (build_segments(ids, "cpu", mix_slot=mix) for ids, mix in sweep_batches(max_tokens, slots))
    return {variant(pool, meta, slices, table, flats) for meta in metas
            for flats in layouts(meta, block_ms(pool, meta, slices, table), slots, max_tokens)}


@pytest.mark.parametrize("gpu", ["nvidia_h100_80gb_hbm3", "nvidia_h200"])
@pytest.mark.parametrize("slices,slots,max_tokens", [(QKV_7B, 32, 8192), (O_7B, 8, 4096), (QKV_7B, 4, 8192)])
def test_every_live_batch_needs_only_swept_variants(gpu, slices, slots, max_tokens):
    table = TilingTable.load(TABLE_DIR / f"{gpu}.json")
    pool = _pool(slices, slots)
    swept = _swept(pool, slices, table, max_tokens, slots)
    rng = np.random.default_rng(0)
    for _ in range(400):
        ids, mix = _live_batch(rng, max_tokens, slots)
        meta = build_segments(ids, "cpu", mix_slot=mix)
        assert variant(pool, meta, slices, table) in swept, \
            f"{len(ids)} tokens, {meta.num_segments} segments, longest {meta.max_seg_len}, mix {mix}"


def test_the_waves_alone_miss_variants_the_sweep_has():
    """Why the sweep exists: batches of whole 803-token prompts on 4 adapters beside the base model
    (as the waves make them) meet fewer variants than live steps of the same engine can."""
    table = TilingTable.load(TABLE_DIR / "nvidia_h100_80gb_hbm3.json")
    pool = _pool(QKV_7B, 8)
    waves = set()
    for n in (1, 2, 4, 8, 10):  # requests per step, the i-th on adapter i % 5 (4: the base model)
        ids = [i % 5 if i % 5 < 4 else -1 for i in range(n) for _ in range(803)][:8192]
        waves.add(variant(pool, build_segments(ids, "cpu"), QKV_7B, table))
    assert waves < _swept(pool, QKV_7B, table, 8192, 8)


def test_an_engine_that_never_merges_sweeps_no_mixture():
    assert any(mix is not None for _, mix in sweep_batches(64, 4))
    assert all(mix is None for _, mix in sweep_batches(64, 4, mixture=False))


def test_sweep_batches_cover_every_bucket_pair():
    pairs = {(len(ids), int(max(np.unique([i for i in ids if i >= 0], return_counts=True)[1])))
             for ids, _ in sweep_batches(64, 4)}
    buckets = {(1 << (t - 1).bit_length(), 1 << (s - 1).bit_length()) for t, s in pairs}
    want = {(t, s) for t in (1, 2, 4, 8, 16, 32, 64) for s in (1, 2, 4, 8, 16, 32, 64) if s <= t}
    assert buckets == want


def test_the_sweep_runs_the_operator_and_leaves_the_model_as_it_was(tiny_zoo, tmp_path):
    """On CPU through the Triton interpreter (the GPU's kernels, interpreted): the sweep launches, and
    the pool, the weights and a request's answer are what they were."""
    path = make_adapter(tiny_zoo["qwen2_vl_tiny"], tmp_path / "a", ["q_proj", "v_proj"], 8, 16, 5)
    engine = Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(
        device="cpu", dtype="bfloat16", lora_backend="triton", num_kv_blocks=64, max_batch_size=4,
        max_tokens_per_step=16, warm_up="off", adapters=(f"a={path}",)))
    request = Request(prompt="Describe it.", adapter="a", sampling=SamplingParams(max_tokens=3),
                      images=[np.random.default_rng(1).integers(0, 256, (56, 56, 3), dtype=np.uint8)])
    before = engine.generate([request])[0].token_ids
    state = {k: v.clone() for k, v in engine.lora.pool.lora_a.items()} | \
        {f"w{i}": m.base.weight.detach().clone() for i, m in enumerate(engine.lora.layers)}
    assert sweep_lora_kernels(engine) > 0
    after = {k: v for k, v in engine.lora.pool.lora_a.items()} | \
        {f"w{i}": m.base.weight.detach() for i, m in enumerate(engine.lora.layers)}
    assert all(torch.equal(state[k], after[k]) for k in state)
    assert engine.generate([Request(prompt="Describe it.", adapter="a", sampling=SamplingParams(max_tokens=3),
                                    images=request.images)])[0].token_ids == before
