"""ATMM shrink/expand against the fp32 reference (CPU: through the Triton interpreter)."""

from __future__ import annotations

import pytest
import torch
from lora_cases import make_batch, make_pool, rel_err

from vlora_kernels.expand import expand
from vlora_kernels.lora import add_lora, configs_for
from vlora_kernels.reference import lora_einsum, lora_gather_bmm, lora_loop, lora_reference
from vlora_kernels.segments import build_segments
from vlora_kernels.shrink import shrink
from vlora_kernels.tiling import TileConfig

TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _run(slot_ids, slices, k, max_rank, n_slots, dtype, seed, shrink_cfg=None, expand_cfg=None, **pool_kw):
    lora_a, lora_b, ranks, scales = make_pool(n_slots, slices, k, max_rank, dtype, seed, **pool_kw)
    x, y0, meta = make_batch(len(slot_ids), k, sum(slices), slot_ids, dtype, seed)
    ref = lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    out = add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices,
                   shrink_config=shrink_cfg, expand_config=expand_cfg)
    return y0, ref, out, torch.tensor(slot_ids, device=out.device)


def _check(y0, ref, out, slot_ids, dtype):
    lora_rows = slot_ids >= 0
    if lora_rows.any():
        assert rel_err(out[lora_rows] - y0[lora_rows], ref[lora_rows] - y0[lora_rows]) < TOL[dtype]
    assert torch.equal(out[~lora_rows], y0[~lora_rows]), "tokens without LoRA are untouched"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k, slices", [(64, (48,)), (33, (32, 16, 16)), (96, (40, 24))])
@pytest.mark.parametrize("split_k", [1, 4])
def test_matches_reference_over_sizes_slices_and_splits(dtype, k, slices, split_k):
    g = torch.Generator().manual_seed(k + split_k)
    slot_ids = torch.randint(-1, 5, (23,), generator=g).tolist()  # 5 adapters and some no-LoRA tokens
    cfgs = (TileConfig(16, 16, 16, split_k), TileConfig(16, 32, 16))
    _check(*_run(slot_ids, slices, k, 16, 5, dtype, seed=k, shrink_cfg=cfgs[0], expand_cfg=cfgs[1]), dtype)


def test_ranks_1_to_128_mixed_in_one_batch():
    ranks = [1, 7, 8, 16, 33, 64, 100, 128]
    slot_ids = [i % len(ranks) for i in range(40)]
    out = _run(slot_ids, (32,), 48, 128, len(ranks), torch.bfloat16, seed=3, rank_choices=ranks,
               shrink_cfg=TileConfig(16, 64, 16, 2), expand_cfg=TileConfig(32, 32, 32))
    _check(*out, torch.bfloat16)


@pytest.mark.parametrize("n_adapters", [1, 8, 64])
def test_one_launch_serves_any_number_of_adapters(n_adapters):
    slot_ids = [i % n_adapters for i in range(64)]  # interleaved: segments gather tokens by slot
    _check(*_run(slot_ids, (32,), 32, 16, 64, torch.float16, seed=n_adapters), torch.float16)


def test_untargeted_slices_and_no_lora_segments():
    slot_ids = [-1, 0, 0, 1, -1, 2, 2, 2, -1, 3]
    out = _run(slot_ids, (16, 16, 32), 32, 16, 4, torch.bfloat16, seed=9, untargeted=0.4)
    _check(*out, torch.bfloat16)


def test_all_tokens_without_lora_leave_y_untouched():
    y0, ref, out, _ = _run([-1] * 7, (32,), 32, 16, 2, torch.float16, seed=1)
    assert torch.equal(out, y0) and torch.equal(ref, y0)


def test_padded_metadata_for_graph_capture_gives_the_same_result():
    slot_ids = [2, 0, 2, -1, 1]
    dtype, slices = torch.float16, (32,)
    lora_a, lora_b, ranks, scales = make_pool(4, slices, 32, 16, dtype, seed=5)
    x, y0, meta = make_batch(5, 32, 32, slot_ids, dtype, seed=5)
    _, _, padded = make_batch(5, 32, 32, slot_ids, dtype, seed=5, max_segments=4, max_tokens=8)
    assert padded.num_segments == 4 and padded.max_seg_len == 8
    a = add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    b = add_lora(y0.clone(), x, lora_a, lora_b, padded, ranks, scales, slices)
    assert torch.equal(a, b)


def test_every_rank_column_of_v_is_written():
    """Poison v first: every column below a token's rank must be overwritten by the shrink."""
    lora_a, _, ranks, _ = make_pool(3, (32,), 40, 32, torch.float16, seed=4)
    x, _, meta = make_batch(9, 40, 32, [0, 1, 2] * 3, torch.float16, seed=4)
    v = torch.full((1, 1, 9, 32), float("nan"), device=x.device)
    shrink(x, lora_a, meta, ranks, TileConfig(16, 16, 16), out=v)
    for t in range(9):
        r = int(ranks[0, t % 3])
        assert torch.isfinite(v[0, 0, t, :r]).all()
        expected = x[t].float() @ lora_a[0, t % 3, :r].float().T
        assert rel_err(v[0, 0, t, :r], expected) < 2e-3


@pytest.mark.parametrize("impl", [lora_loop, lora_gather_bmm, lora_einsum], ids=lambda f: f.__name__)
def test_baselines_match_reference(impl):
    slot_ids = [3, 3, -1, 0, 1, 1, 1, 2, -1, 0]
    slices, dtype = (24, 8, 8), torch.float32
    lora_a, lora_b, ranks, scales = make_pool(4, slices, 32, 16, dtype, seed=7, untargeted=0.3)
    x, y0, meta = make_batch(len(slot_ids), 32, sum(slices), slot_ids, dtype, seed=7)
    ref = lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    out = impl(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    assert rel_err(out - y0, ref - y0) < 1e-5


def test_bad_inputs_are_named():
    lora_a, lora_b, ranks, scales = make_pool(2, (32,), 32, 16, torch.float16, seed=0)
    x, y, meta = make_batch(4, 32, 32, [0, 1, 0, 1], torch.float16, seed=0)
    with pytest.raises(TypeError, match="x must be float16 or bfloat16"):
        add_lora(y, x.float(), lora_a, lora_b, meta, ranks, scales, (32,))
    with pytest.raises(ValueError, match="lora_a must be"):
        add_lora(y, x[:, :16].contiguous(), lora_a, lora_b, meta, ranks, scales, (32,))
    with pytest.raises(ValueError, match="ranks must be int32"):
        add_lora(y, x, lora_a, lora_b, meta, ranks.long(), scales, (32,))
    with pytest.raises(ValueError, match="slices"):
        add_lora(y, x, lora_a, lora_b, meta, ranks, scales, (16, 16))
    past_pool = build_segments([0, 2, -1, 1], device=x.device)  # slot 2 of a 2-slot pool
    with pytest.raises(ValueError, match="names adapter slot 2 but the pool has 2 slots"):
        add_lora(y, x, lora_a, lora_b, past_pool, ranks, scales, (32,))
    with pytest.raises(ValueError, match="names adapter slot 2"):
        expand(y, torch.zeros(1, 1, 4, 16, device=x.device), lora_b, past_pool, ranks, scales, (32,),
               TileConfig(16, 16, 16))
    mixed_past = build_segments([0, 1, -2, 1], device=x.device, mix_slot=5)
    with pytest.raises(ValueError, match="names adapter slot 5"):
        add_lora(y, x, lora_a, lora_b, mixed_past, ranks, scales, (32,))


def test_configs_come_from_the_table_or_the_heuristic():
    lora_a, *_ = make_pool(2, (32,), 32, 16, torch.float16, seed=0)
    x, _, meta = make_batch(4, 32, 32, [0, 1, 0, 1], torch.float16, seed=0)
    shrink_cfg, expand_cfg = configs_for(x, lora_a, meta, (32,))
    assert shrink_cfg.block_n == 16 and expand_cfg.block_k == 16  # whole rank in one tile


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["distinct", "skewed", "identical"])
@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_real_shapes_on_the_gpu(mix, tokens):
    """Full-size shapes (hidden 4096, fused q/k/v of a GQA model) with tiled configs from the table."""
    from vlora_kernels.workload import token_slots

    slices = (3584, 512, 512)
    slot_ids = token_slots(tokens, mix)
    _check(*_run(slot_ids, slices, 3584, 64, 64, torch.bfloat16, seed=tokens, rank_choices=[8, 16, 64]),
           torch.bfloat16)


def test_pool_rank_that_is_not_a_power_of_two():
    """A pool of max rank 48: the expand's reduction step shrinks to one that divides it."""
    slot_ids = [0, 1, 2, 1, 0, -1]
    out = _run(slot_ids, (32, 16), 32, 48, 3, torch.float16, seed=12, rank_choices=[5, 40, 48],
               shrink_cfg=TileConfig(16, 64, 16), expand_cfg=TileConfig(16, 32, 32))
    _check(*out, torch.float16)


# ---- mixture (deLoRA) in one launch pair ------------------------------------------------------
def _mixture_case(slot_ids, mix, slices, k, max_rank, n_slots, dtype, seed, **pool_kw):
    """(y0, the two-pass fp32 reference, the one-pass kernel, token mask of touched rows)."""
    lora_a, lora_b, ranks, scales = make_pool(n_slots, slices, k, max_rank, dtype, seed, **pool_kw)
    x, y0, meta = make_batch(len(slot_ids), k, sum(slices), slot_ids, dtype, seed, mix_slot=mix)
    # two passes, as deLoRA was computed before: each token's own adapter, then -dW_mix for all of them
    own = build_segments([s if s >= 0 else -1 for s in slot_ids], device=x.device)
    neg = build_segments([mix if s != -1 else -1 for s in slot_ids], device=x.device)
    ref = lora_reference(y0.clone().float(), x, lora_a, lora_b, own, ranks, scales, slices)
    ref = lora_reference(ref, x, lora_a, lora_b, neg, ranks, -scales, slices).to(dtype)
    out = add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    return y0, ref, out, torch.tensor(slot_ids, device=out.device) != -1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k, slices", [(64, (48,)), (33, (32, 16, 16)), (96, (40, 24))])
def test_mixture_in_one_pass_matches_two_passes(dtype, k, slices):
    g = torch.Generator().manual_seed(k)
    slot_ids = torch.randint(-2, 5, (29,), generator=g).tolist()  # own adapters, none (-1), mixed-in only (-2)
    y0, ref, out, touched = _mixture_case(slot_ids, 2, slices, k, 16, 5, dtype, seed=k)
    assert rel_err(out[touched] - y0[touched], ref[touched] - y0[touched]) < TOL[dtype]
    assert torch.equal(out[~touched], y0[~touched]), "tokens of the merged adapter (-1) are untouched"


@pytest.mark.parametrize("split_k", [1, 4])
def test_mixture_ranks_1_to_128_and_split_k(split_k):
    ranks = [1, 7, 16, 33, 64, 100, 128]
    slot_ids = [i % len(ranks) for i in range(30)] + [-2, -1, -2]
    for mix in (0, 5):  # a rank-1 and a rank-100 adapter mixed in
        lora_a, lora_b, rk, scales = make_pool(len(ranks), (32, 16), 48, 128, torch.bfloat16, 3, rank_choices=ranks)
        x, y0, meta = make_batch(len(slot_ids), 48, 48, slot_ids, torch.bfloat16, 3, mix_slot=mix)
        ref = lora_reference(y0.clone(), x, lora_a, lora_b, meta, rk, scales, (32, 16))
        out = add_lora(y0.clone(), x, lora_a, lora_b, meta, rk, scales, (32, 16),
                       shrink_config=TileConfig(16, 32, 16, split_k), expand_config=TileConfig(16, 16, 32))
        assert rel_err(out[:-2] - y0[:-2], ref[:-2] - y0[:-2]) < TOL[torch.bfloat16]
        assert torch.equal(out[-2], y0[-2])


def test_mixture_of_an_adapter_with_itself_cancels():
    """A token of adapter s with s mixed in adds dW_s - dW_s: y comes back to within rounding."""
    lora_a, lora_b, ranks, scales = make_pool(3, (32,), 32, 16, torch.float32, seed=2)
    x, y0, meta = make_batch(6, 32, 32, [1] * 6, torch.float32, seed=2, mix_slot=1)
    out = lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, (32,))
    assert (out - y0).abs().max() < 1e-5


def test_mixture_untargeted_slices_and_padded_graph_metadata():
    slot_ids = [0, -2, 1, -1, 3, 3, -2]
    dtype, slices = torch.float16, (16, 16, 32)
    lora_a, lora_b, ranks, scales = make_pool(4, slices, 32, 16, dtype, seed=6, untargeted=0.4)
    x, y0, meta = make_batch(7, 32, 64, slot_ids, dtype, seed=6, mix_slot=1)
    _, _, padded = make_batch(7, 32, 64, slot_ids, dtype, seed=6, mix_slot=1, max_segments=5, max_tokens=8)
    ref = lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    a = add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    b = add_lora(y0.clone(), x, lora_a, lora_b, padded, ranks, scales, slices)
    assert torch.equal(a, b)
    touched = torch.tensor(slot_ids, device=a.device) != -1
    assert rel_err(a[touched] - y0[touched], ref[touched] - y0[touched]) < TOL[dtype]
    assert torch.equal(a[3], y0[3])


@pytest.mark.parametrize("impl", [lora_loop, lora_gather_bmm, lora_einsum], ids=lambda f: f.__name__)
def test_baselines_match_reference_in_mixture(impl):
    slot_ids = [3, -2, -1, 0, 1, 1, -2, 2, -1, 0]
    slices, dtype = (24, 8, 8), torch.float32
    lora_a, lora_b, ranks, scales = make_pool(4, slices, 32, 16, dtype, seed=8, untargeted=0.3)
    x, y0, meta = make_batch(len(slot_ids), 32, sum(slices), slot_ids, dtype, seed=8, mix_slot=2)
    ref = lora_reference(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    out = impl(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
    assert rel_err(out - y0, ref - y0) < 1e-5
    assert torch.equal(out[[2, 8]], y0[[2, 8]])


def test_mixture_metadata_is_checked():
    with pytest.raises(ValueError, match="-2 = only the mixed-in slot"):
        build_segments([0, -3], mix_slot=1)
    with pytest.raises(ValueError, match=r"must be >= -1"):
        build_segments([0, -2])  # -2 means something only in a mixture batch
    with pytest.raises(ValueError, match="mix_slot must be a pool slot"):
        build_segments([0], mix_slot=-1)


def test_mixture_graph_buffers_compute_what_the_step_metadata_computes():
    """The CUDA-graph path's fixed buffers (serve.lora.MixtureGraphBuffers: the bucket's static
    metadata, loaded before each replay) give the same y as the step's own mixture metadata, for
    batches with every slot used and the merged slot moved between loads."""
    from serve.lora.modes import MixtureGraphBuffers, build_mixture_batch

    n_slots, bs, slices = 4, 8, (32,)
    lora_a, lora_b, ranks, scales = make_pool(n_slots, slices, 32, 16, torch.float16, seed=11)
    buffers = MixtureGraphBuffers(bs, n_slots, lora_a.device, "triton")
    static = buffers.static_batch(bs)
    for merged, slots in ((0, [1, 2, 3, -1, 0, 3, -1]), (3, [0, 1, 2, -1, 3, 3, 0, 1]), (2, [2, 2, 1])):
        batch = build_mixture_batch(slots, merged, lora_a.device, "triton")
        x, y0, _ = make_batch(bs, 32, 32, [-1] * bs, torch.float16, seed=merged)
        direct = add_lora(y0[:len(slots)].clone(), x[:len(slots)], lora_a, lora_b, batch.segments, ranks, scales,
                          slices)
        buffers.load(batch, bs)
        replayed = add_lora(y0.clone(), x, lora_a, lora_b, static.segments, ranks, scales, slices)
        assert torch.equal(replayed[:len(slots)], direct)
        assert torch.equal(replayed[len(slots):], y0[len(slots):]), "padding rows are untouched"


def test_mix_bounded_graph_buffers_compute_what_the_step_metadata_computes():
    """A LoRA graph captured for steps of at most s adapters with at most n tokens each (serve.lora's
    `static_batch(bs, n, s)`, gridded and tiled for that mix) gives the step's own result for every
    step `pick_variant` sends to it; a step past either bound would lose tokens, so it goes to a
    looser graph."""
    from collections import Counter

    from serve.lora.metadata import LoraGraphBuffers, graph_variants, pick_variant

    n_slots, bs, slices = 6, 8, (32,)
    lora_a, lora_b, ranks, scales = make_pool(n_slots, slices, 32, 16, torch.float16, seed=12)
    buffers = LoraGraphBuffers(bs, n_slots, lora_a.device, "triton")
    variants = graph_variants(bs, buffers.num_segments(bs), segments=(1, 3), seg_lens=(1, 2))
    assert variants == [(1, 1), (1, 2), (1, 8), (3, 1), (3, 2), (3, 8), (6, 1), (6, 2), (6, 8)]
    static = {v: buffers.static_batch(bs, v[1], v[0]) for v in variants}
    assert all((b.segments.num_segments, b.segments.max_seg_len) == v for v, b in static.items())
    picked = set()
    for slots in ([0, 1, 2, -1, 5], [3, 1, 3, -1, 4, 1], [2, 2, 2, 0, -1, 1, 2], [-1, 4], [5, 5, 5, 5, 5],
                  [1, 1, 0, 0], [0, 1, 2, 3, 4, 5, -1], [0, 1, 2], [0, 0, 1, 2, 3], [0, 0, 0, 1, 2, 3]):
        x, y0, meta = make_batch(bs, 32, 32, slots + [-1] * (bs - len(slots)), torch.float16, seed=len(slots))
        direct = add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)
        counts = Counter(s for s in slots if s >= 0)
        segments, longest = buffers.load(tuple(slots), bs)
        assert (segments, longest) == (len(counts), max(counts.values()))
        v = pick_variant(segments, longest, variants)
        assert v == min(((s, n) for s, n in variants if s >= segments and n >= longest), key=lambda v: v[0] * v[1])
        picked.add(v)
        replayed = add_lora(y0.clone(), x, lora_a, lora_b, static[v].segments, ranks, scales, slices)
        assert torch.equal(replayed, direct), (slots, v)
    assert picked == {(1, 1), (1, 8), (3, 1), (3, 2), (3, 8), (6, 1), (6, 2), (6, 8)}
    # the guards matter: an adapter with more tokens than one token tile (block_m >= 16) holds, or
    # more adapters than the graph has segments, replayed in the narrower graph, loses tokens
    wide = LoraGraphBuffers(32, n_slots, lora_a.device, "triton")
    for slots, narrow in (([2] * 20 + [0, 1, -1], (6, 1)), ([0, 1, 2, 3, -1], (3, 32))):
        x, y0, meta = make_batch(32, 32, 32, slots + [-1] * (32 - len(slots)), torch.float16, seed=7)
        wide_variants = graph_variants(32, wide.num_segments(32), segments=(3,), seg_lens=(1,))
        assert narrow in wide_variants and pick_variant(*wide.load(tuple(slots), 32), wide_variants) != narrow
        lost = add_lora(y0.clone(), x, lora_a, lora_b, wide.static_batch(32, narrow[1], narrow[0]).segments, ranks,
                        scales, slices)
        assert not torch.equal(lost, add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, slices)), narrow


def test_pdl_is_used_only_where_the_device_can(monkeypatch):
    from vlora_kernels.interpreter import pdl_available

    assert not pdl_available(torch.device("cpu"))
    if torch.cuda.is_available():
        monkeypatch.setenv("VLORA_PDL", "0")
        assert not pdl_available(torch.device("cuda", 0)), "VLORA_PDL=0 turns it off"
    # asked for where it cannot run, the op falls back to the plain launches and the same result
    y0, ref, out, slot_ids = _run([0, 1, 1, -1, 0], (32,), 32, 16, 2, torch.float16, seed=2)
    lora_a, lora_b, ranks, scales = make_pool(2, (32,), 32, 16, torch.float16, seed=2)
    x, y1, meta = make_batch(5, 32, 32, [0, 1, 1, -1, 0], torch.float16, seed=2)
    forced = add_lora(y1.clone(), x, lora_a, lora_b, meta, ranks, scales, (32,), pdl=True)
    assert torch.equal(forced, out)


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["distinct", "skewed", "identical"])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_pdl_launch_gives_the_bits_of_the_plain_launches_in_a_cuda_graph(mix, tokens):
    """The expand launched behind the running shrink (programmatic dependent launch), replayed in
    a CUDA graph over fresh inputs: the same bits as the plain two launches, every replay."""
    from vlora_kernels.interpreter import pdl_available
    from vlora_kernels.workload import token_slots

    if not pdl_available(torch.device("cuda", 0)):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    slices, k = (3584, 512, 512), 3584
    slot_ids = token_slots(tokens, mix)
    lora_a, lora_b, ranks, scales = make_pool(64, slices, k, 64, torch.bfloat16, seed=tokens, rank_choices=[16, 64])
    x, y0, meta = make_batch(tokens, k, sum(slices), slot_ids, torch.bfloat16, seed=tokens)
    y = y0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        add_lora(y, x, lora_a, lora_b, meta, ranks, scales, slices, pdl=True)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):  # back to back: each shrink behind the previous expand, as in a model's layers
            add_lora(y, x, lora_a, lora_b, meta, ranks, scales, slices, pdl=True)
    for seed in range(4):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        y.copy_(y0)
        graph.replay()
        want = y0.clone()
        for _ in range(3):
            add_lora(want, x, lora_a, lora_b, meta, ranks, scales, slices, pdl=False)
        assert torch.equal(y, want), f"replay {seed}"


def _beside_case(tokens, mix, seed, device=None):
    from vlora_kernels.workload import token_slots

    slices, k = ((3584, 512, 512), 3584) if torch.cuda.is_available() else ((32, 16, 16), 48)
    slot_ids = token_slots(tokens, mix)
    lora_a, lora_b, ranks, scales = make_pool(max(slot_ids) + 1, slices, k, 16, torch.bfloat16, seed=seed)
    x, _, meta = make_batch(tokens, k, sum(slices), slot_ids, torch.bfloat16, seed=seed)
    weight = (torch.randn(sum(slices), k, generator=torch.Generator().manual_seed(seed)) / k**0.5).to(x)
    return (lambda inp: torch.nn.functional.linear(inp, weight)), x, (lora_a, lora_b, meta, ranks, scales, slices)


@pytest.mark.parametrize("mix", ["distinct", "identical"])
def test_add_lora_beside_returns_what_add_lora_after_the_base_returns(mix):
    """base(x) + LoRA(x) with the shrink beside the base matmul (a side stream on a GPU; add_lora
    after base on CPU): the same bits as the plain order, and the same as the reference."""
    from vlora_kernels.lora import add_lora_beside

    base, x, (lora_a, lora_b, meta, ranks, scales, slices) = _beside_case(8, mix, seed=3)
    plain = add_lora(base(x), x, lora_a, lora_b, meta, ranks, scales, slices)
    beside = add_lora_beside(base, x, lora_a, lora_b, meta, ranks, scales, slices)
    assert torch.equal(beside, plain)
    ref = lora_reference(base(x), x, lora_a, lora_b, meta, ranks, scales, slices)
    assert rel_err(beside - base(x), ref - base(x)) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("mix", ["distinct", "skewed", "identical"])
def test_add_lora_beside_in_a_cuda_graph_gives_the_plain_bits(mix):
    """Captured with its side stream (forked and joined per call) and replayed over fresh inputs:
    every replay equals the plain order, eagerly."""
    from vlora_kernels.lora import add_lora_beside

    base, x, (lora_a, lora_b, meta, ranks, scales, slices) = _beside_case(32, mix, seed=4)

    def layers(inp):  # three projections back to back, each feeding the next, as a model's layers do
        for _ in range(3):
            inp = add_lora_beside(base, inp, lora_a, lora_b, meta, ranks, scales, slices)[:, :inp.shape[1]]
        return inp

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layers(x)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layers(x)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        want = x
        for _ in range(3):
            want = add_lora(base(want), want, lora_a, lora_b, meta, ranks, scales, slices)[:, :x.shape[1]]
        assert torch.equal(out, want), f"replay {seed}"


# The expand's column groups (`col_tiles` > 1): one program loops over several column tiles with
# its tokens' v held. Odd widths end a group part way and slices end between tiles of a group.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k, slices", [(64, (48,)), (33, (32, 16, 16)), (96, (40, 24)), (40, (100,))])
@pytest.mark.parametrize("split_k, col_tiles", [(1, 2), (4, 2), (1, 4)])
def test_expand_column_groups_match_reference(dtype, k, slices, split_k, col_tiles):
    g = torch.Generator().manual_seed(k + split_k + col_tiles)
    slot_ids = torch.randint(-1, 5, (23,), generator=g).tolist()
    cfgs = (TileConfig(16, 16, 16, split_k), TileConfig(16, 16, 16, col_tiles=col_tiles))
    _check(*_run(slot_ids, slices, k, 16, 5, dtype, seed=k, shrink_cfg=cfgs[0], expand_cfg=cfgs[1]), dtype)


def test_expand_column_groups_over_ranks_1_to_128():
    ranks = [1, 7, 8, 16, 33, 64, 100, 128]
    slot_ids = [i % len(ranks) for i in range(40)]
    out = _run(slot_ids, (32, 48), 48, 128, len(ranks), torch.bfloat16, seed=3, rank_choices=ranks,
               shrink_cfg=TileConfig(16, 64, 16, 2), expand_cfg=TileConfig(32, 16, 128, col_tiles=2))
    _check(*out, torch.bfloat16)


def test_expand_column_groups_write_each_column_once():
    """Every column of every LoRA token gets its update once: y starts as NaN-free random, and a
    group past the slice's end or a repeated tile would double or skip a column's update."""
    slot_ids = [0, 0, 1, -1, 2, 2, 2, 1]
    lora_a, lora_b, ranks, scales = make_pool(3, (80, 16), 32, 16, torch.float16, seed=2)
    x, y0, meta = make_batch(len(slot_ids), 32, 96, slot_ids, torch.float16, seed=2)
    one = add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, (80, 16),
                   shrink_config=TileConfig(16, 16, 16), expand_config=TileConfig(16, 16, 16))
    for cols in (2, 4, 8):
        grouped = add_lora(y0.clone(), x, lora_a, lora_b, meta, ranks, scales, (80, 16),
                           shrink_config=TileConfig(16, 16, 16), expand_config=TileConfig(16, 16, 16, col_tiles=cols))
        assert torch.allclose(grouped.float(), one.float(), atol=2e-3, rtol=0), cols
