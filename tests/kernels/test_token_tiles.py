"""The flat token grid (vlora_kernels/token_tiles.py): the same result as the by-segment grid, on every
kind of batch it may meet, with fewer programs where segments are uneven (CPU: Triton interpreter)."""

from __future__ import annotations

import pytest
import torch
from lora_cases import make_batch, make_pool, rel_err

from vlora_kernels.lora import add_lora
from vlora_kernels.reference import lora_reference
from vlora_kernels.segments import build_segments
from vlora_kernels.shrink import shrink
from vlora_kernels.tiling import TileConfig
from vlora_kernels.token_tiles import flat_tiles, seg_block, token_grid


def _skewed(n_tokens: int, seed: int, with_gaps: bool = True) -> list[int]:
    """One hot adapter and a tail of short ones, with no-LoRA tokens between (the engine
    interleaves requests; segments gather them)."""
    g = torch.Generator().manual_seed(seed)
    hot = [0] * (n_tokens * 2 // 3)
    tail = torch.randint(1, 7, (n_tokens - len(hot),), generator=g).tolist()
    ids = hot + tail
    if with_gaps:
        ids = [(-1 if i % 11 == 5 else s) for i, s in enumerate(ids)]
    order = torch.randperm(len(ids), generator=g).tolist()
    return [ids[i] for i in order]


def _both(slot_ids, slices, k, dtype, seed, shrink_cfg, expand_cfg, mix_slot=None, **meta_kw):
    lora_a, lora_b, ranks, scales = make_pool(8, slices, k, 32, dtype, seed)
    x, y0, meta = make_batch(len(slot_ids), k, sum(slices), slot_ids, dtype, seed, mix_slot=mix_slot, **meta_kw)
    runs = [add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices, shrink_config=shrink_cfg,
                     expand_config=expand_cfg, flat=flat) for flat in (True, False)]
    ref = lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    return y0, ref, runs, meta


@pytest.mark.parametrize("split_k, col_tiles", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("k, slices", [(48, (32,)), (33, (16, 16, 32))])
def test_flat_grid_gives_the_bits_of_the_by_segment_grid(split_k, col_tiles, k, slices):
    slot_ids = _skewed(150, seed=k + split_k)
    y0, ref, (flat, by_seg), meta = _both(slot_ids, slices, k, torch.float16, k, TileConfig(16, 32, 16, split_k),
                                          TileConfig(32, 16, 16, col_tiles=col_tiles))
    assert seg_block(meta, 16) > 0, "this batch is one the flat grid is picked for"
    assert torch.equal(flat, by_seg)
    lora = torch.tensor(slot_ids, device=flat.device) >= 0
    assert rel_err(flat[lora] - y0[lora], ref[lora] - y0[lora]) < 3e-3
    assert torch.equal(flat[~lora], y0[~lora]), "tokens without LoRA are untouched"


def test_each_launch_takes_its_own_layout(monkeypatch):
    """flat as a (shrink, expand) pair: each launch on its own grid (the warm-up's sweep compiles the
    mixed pairs live batches reach), the same bits as either layout on both."""
    import vlora_kernels.lora as lora

    seen = []
    for name in ("shrink", "expand"):
        real = getattr(lora, name)
        monkeypatch.setattr(lora, name, lambda *a, _real=real, _name=name, **kw: (seen.append((_name, kw["flat"])),
                                                                                    _real(*a, **kw))[1])
    slot_ids = _skewed(150, seed=7)
    lora_a, lora_b, ranks, scales = make_pool(8, (32,), 48, 32, torch.float16, 7)
    x, y0, meta = make_batch(len(slot_ids), 48, 32, slot_ids, torch.float16, 7)
    cfgs = dict(shrink_config=TileConfig(16, 32, 16, 2), expand_config=TileConfig(32, 16, 16))
    runs = [add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, (32,), flat=flat, **cfgs)
            for flat in (False, (True, False), (False, True))]
    assert all(torch.equal(run, runs[0]) for run in runs[1:])
    assert seen[2:] == [("shrink", True), ("expand", False), ("shrink", False), ("expand", True)]


def test_flat_grid_in_a_mixture_batch_and_with_padded_graph_metadata():
    """Mixture (deLoRA) batches, and metadata padded to fixed sizes as a CUDA graph captures it
    (empty segments, a token bound past the batch): the flat bound must cover every tile."""
    slot_ids = [(-2 if i % 7 == 0 else s) for i, s in enumerate(_skewed(120, seed=3))]
    cfgs = TileConfig(16, 16, 16, 2), TileConfig(16, 32, 16)
    y0, ref, (flat, by_seg), _ = _both(slot_ids, (32, 16), 40, torch.bfloat16, 5, *cfgs, mix_slot=4)
    assert torch.equal(flat, by_seg)
    _, _, (padded_flat, padded_by_seg), padded = _both(slot_ids, (32, 16), 40, torch.bfloat16, 5, *cfgs, mix_slot=4,
                                                         max_segments=12, max_tokens=160)
    assert padded.num_segments == 12 and padded.max_seg_len == 160
    assert torch.equal(padded_flat, flat) and torch.equal(padded_by_seg, flat)
    touched = torch.tensor(slot_ids, device=flat.device) != -1
    assert rel_err(flat[touched] - y0[touched], ref[touched] - y0[touched]) < 2e-2


def test_every_token_row_of_v_is_written_by_the_flat_shrink():
    """Poison v: the flat grid must reach every tile of every segment, the last one's last included."""
    slot_ids = [0] * 97 + [1] * 17 + [2] + [3] * 33  # tile counts 7, 2, 1, 3 at block_m 16
    lora_a, _, ranks, _ = make_pool(4, (32,), 40, 32, torch.float16, seed=4, rank_choices=[32])
    x, _, meta = make_batch(len(slot_ids), 40, 32, slot_ids, torch.float16, seed=4)
    v = torch.full((1, 1, len(slot_ids), 32), float("nan"), device=x.device)
    shrink(x, lora_a, meta, ranks, TileConfig(16, 32, 16), out=v, flat=True)
    expected = torch.stack([x[t].float() @ lora_a[0, s].float().T for t, s in enumerate(slot_ids)])
    assert torch.isfinite(v).all()
    assert rel_err(v[0, 0], expected) < 2e-3


def test_the_flat_grid_is_picked_where_it_launches_fewer_programs():
    skewed = build_segments([0] * 900 + list(range(1, 25)) * 4)  # one long segment, 24 short ones
    assert token_grid(skewed, 64, 0) == (25, 15)  # 375 programs on the token axes
    assert flat_tiles(skewed, 64) == (996 + 25 * 63) // 64 == 40
    assert seg_block(skewed, 64) == 128 and token_grid(skewed, 64, 128) == (40, 1)
    equal = build_segments([i // 128 for i in range(1024)])  # 8 segments of 128: already exact
    assert seg_block(equal, 64) == 0
    decode = build_segments([0] * 60 + [1, 2, 3, 4])  # decode-sized: always by segment
    assert seg_block(decode, 16) == 0
    assert seg_block(decode, 16, flat=True) == 128 and seg_block(skewed, 64, flat=False) == 0
    assert seg_block(build_segments(list(range(300)) * 2), 16, flat=True) == 512
    many = build_segments(list(range(1100)))
    assert seg_block(many, 16) == 0
    with pytest.raises(ValueError, match="at most 1024 segments"):
        seg_block(many, 16, flat=True)
