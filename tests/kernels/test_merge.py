"""The all-layer merge kernel against its fp32 reference and PEFT (CPU: through the Triton interpreter)."""

import os

import torch  # does not import triton

# Compiled kernels on a GPU when there is one; otherwise the Triton interpreter, which must be
# chosen before triton is first imported.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from vlora_kernels.merge import (  # noqa: E402
    MergeGroup, merge_floor_bytes, merge_groups_, merge_lora_, merge_lora_ref_, unmerge_lora_)

REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def make_group(layers, widths, k, r_max, rank_table, dtype, device=DEVICE, seed=0):
    """Random weights and pools; pool columns past each slot's real rank hold NaN, so any read of
    them poisons the result. rank_table: [n_slices][S]."""
    g = torch.Generator().manual_seed(seed)
    n_slices, n_slots, n_total = len(widths), len(rank_table[0]), sum(widths)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    weight = torch.randn(layers, n_total, k, generator=g)
    lora_a = torch.randn(layers, n_slices, n_slots, r_max, k, generator=g) / r_max**0.5
    lora_b = torch.randn(layers, n_slots, n_total, r_max, generator=g)
    for i in range(n_slices):
        for s in range(n_slots):
            r = rank_table[i][s]
            lora_a[:, i, s, r:] = float("nan")
            lora_b[:, s, offsets[i]:offsets[i + 1], r:] = float("nan")
    ranks = torch.tensor(rank_table, dtype=torch.int32)
    scales = torch.rand(n_slots, generator=g) * 1.5 + 0.5
    to = dict(device=device)
    return MergeGroup(weight.to(dtype=dtype, **to), lora_a.to(dtype=dtype, **to), lora_b.to(dtype=dtype, **to),
                      ranks.to(**to), scales.to(**to), offsets)


def fp32_expected(g, slot, sign=1):
    """weight + sign * delta in fp32, never rounded: the target both implementations approximate."""
    expected = g.weight.float().clone()  # .float() of an fp32 tensor would alias it
    merge_lora_ref_(expected, g.lora_a.float(), g.lora_b.float(), slot, g.ranks, g.scales,
                    g.slice_offsets, sign=sign)
    return expected


def error_scale(g, slot, weight):
    """|weight| + |scale * B @ A| element-wise: what an ulp of rounding is relative to."""
    magnitude = weight.float().abs()
    merge_lora_ref_(magnitude, g.lora_a.float().abs(), g.lora_b.float().abs(), slot, g.ranks,
                    g.scales.abs(), g.slice_offsets)
    return magnitude


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def run_merge(g, slot, sign=1, **config):
    merge_lora_(g.weight, g.lora_a, g.lora_b, slot, g.ranks, g.scales, g.slice_offsets, sign=sign, **config)


CASES = {  # name: (layers, slice widths, K, R_max, ranks [n_slices][S], slot)
    "single_odd": (3, [33], 40, 8, [[4, 8, 1]], 1),
    "qkv_mixed_ranks": (3, [32, 16, 16], 48, 32, [[8, 20, 1, 32], [0, 20, 1, 3], [16, 0, 1, 32]], 1),
    "qkv_untargeted_k": (1, [48, 40, 33], 33, 16, [[2, 16, 5], [16, 0, 5], [1, 7, 5]], 1),
    "gate_up_rank_parts": (1, [40, 40], 48, 64, [[48, 17, 9], [64, 33, 9]], 0),  # 48 = 32 + 16
    "rank_128_pool": (1, [24], 40, 128, [[100, 7]], 0),  # 100 -> 112 = 64 + 32 + 16
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_merge_matches_fp32_reference(case, dtype):
    layers, widths, k, r_max, rank_table, slot = CASES[case]
    g = make_group(layers, widths, k, r_max, rank_table, dtype)
    g.weight[..., 0] = -0.0  # w + 0.0 would flip it to +0.0: untargeted rows must not be rewritten
    expected = fp32_expected(g, slot)
    before = [t.clone() for t in (g.weight, g.lora_a, g.lora_b, g.ranks, g.scales)]
    run_merge(g, slot)
    assert rel_err(g.weight, expected) < REL_TOL[dtype]
    ref = before[0].clone()  # the reference's own rounding: the kernel differs by about an ulp
    merge_lora_ref_(ref, g.lora_a, g.lora_b, slot, g.ranks, g.scales, g.slice_offsets)
    # an ulp of the output's rounding plus fp32 summation error that grows with the rank
    bound = (2 * EPS[dtype] + r_max * EPS[torch.float32]) * error_scale(g, slot, before[0])
    assert ((g.weight.float() - ref.float()).abs() <= bound).all()
    for t, t0 in zip((g.lora_a, g.lora_b, g.ranks, g.scales), before[1:]):  # pools are read-only
        torch.testing.assert_close(t, t0, rtol=0, atol=0, equal_nan=True)
    offs = g.slice_offsets
    for i, row in enumerate(rank_table):
        rows = slice(offs[i], offs[i + 1])
        if row[slot] == 0:  # untargeted slice: bit-exact
            assert torch.equal(g.weight[:, rows].view(torch.uint8), before[0][:, rows].view(torch.uint8))
        else:
            assert not torch.equal(g.weight[:, rows], before[0][:, rows])


@pytest.mark.parametrize("block_n, block_k, k_per_program", [(16, 16, 16), (32, 16, 32), (64, 32, 64)])
def test_tilings_that_cut_slices_agree(block_n, block_k, k_per_program):
    # strips straddle the q|k|v borders (32, 48) or sit inside one slice, edge tiles are partial,
    # and K=40 is cut into several strips
    g = make_group(3, [32, 16, 17], 40, 32, [[20, 1], [0, 2], [32, 3]], torch.float32, seed=1)
    expected = fp32_expected(g, 0)
    run_merge(g, 0, block_n=block_n, block_k=block_k, k_per_program=k_per_program, num_warps=2)
    assert rel_err(g.weight, expected) < REL_TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unmerge_restores_weights(dtype):
    layers, widths, k, r_max, rank_table, slot = CASES["qkv_mixed_ranks"]
    g = make_group(layers, widths, k, r_max, rank_table, dtype, seed=2)
    original = g.weight.clone()
    # two roundings of half an ulp each, plus the fp32 summation error of both products
    bound = (2 * EPS[dtype] + 2 * r_max * EPS[torch.float32]) * error_scale(g, slot, original)
    run_merge(g, slot)
    assert not torch.equal(g.weight, original)
    expected_sub = fp32_expected(g, slot, sign=-1)  # unmerge alone against the exact fp32 subtraction
    unmerge_lora_(g.weight, g.lora_a, g.lora_b, slot, g.ranks, g.scales, g.slice_offsets)
    assert rel_err(g.weight, expected_sub) < REL_TOL[dtype]
    assert ((g.weight.float() - original.float()).abs() <= bound).all()


def test_merge_groups_and_floor_bytes():
    slot = 1
    qkv = make_group(3, [32, 16, 16], 40, 16, [[4, 16], [4, 0], [4, 2]], torch.bfloat16, seed=3)
    down = make_group(3, [24], 48, 16, [[1, 9]], torch.bfloat16, seed=4)
    expected = [fp32_expected(g, slot) for g in (qkv, down)]
    merge_groups_([qkv, down], slot)
    for g, e in zip((qkv, down), expected):
        assert rel_err(g.weight, e) < REL_TOL[torch.bfloat16]
    merge_groups_([qkv, down], slot, sign=-1)
    # floor: weight read + write (2 B each) of targeted slices, A and B read at the real rank
    want = 3 * (2 * 32 * 40 * 2 + (32 + 40) * 16 * 2) + 3 * (2 * 16 * 40 * 2 + (16 + 40) * 2 * 2)
    want += 3 * (2 * 24 * 48 * 2 + (24 + 48) * 9 * 2)
    assert merge_floor_bytes([qkv, down], slot=slot) == want
    assert merge_floor_bytes([(3, [24], 48, 9, 2, 2)]) == 3 * (2 * 24 * 48 * 2 + (24 + 48) * 9 * 2)


def test_matches_peft_merge():
    peft = pytest.importorskip("peft")
    n, k, r, alpha = 40, 33, 8, 16
    torch.manual_seed(5)
    model = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)),
                                peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["0"]))
    layer = model.base_model.model[0]
    a, b = torch.randn(r, k), torch.randn(n, r)
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(a)
        layer.lora_B["default"].weight.copy_(b)
    ours = layer.base_layer.weight.detach().clone()[None].to(DEVICE)  # [1, N, K]
    # a two-slot pool; slot 1 holds the adapter, slot 0 a decoy with another scale and rank
    lora_a = torch.stack([torch.randn(r, k), a])[None, None]  # [1, 1, 2, r, K]
    lora_b = torch.stack([torch.randn(n, r), b])[None]  # [1, 2, N, r]
    scales = torch.tensor([0.3, layer.scaling["default"]], dtype=torch.float32)
    merge_lora_(ours, lora_a.to(DEVICE), lora_b.to(DEVICE), 1, torch.tensor([[3, r]], dtype=torch.int32, device=DEVICE),
                scales.to(DEVICE), [0, n])
    layer.merge()
    torch.testing.assert_close(ours[0].cpu(), layer.base_layer.weight.detach(), rtol=1e-5, atol=1e-5)


def test_bad_inputs_name_the_argument():
    g = make_group(1, [16, 16], 32, 16, [[4, 4], [4, 4]], torch.float32)
    args = (g.weight, g.lora_a, g.lora_b, 0, g.ranks, g.scales, g.slice_offsets)
    with pytest.raises(ValueError, match="sign must be"):
        merge_lora_(*args, sign=2)
    with pytest.raises(ValueError, match="sign must be"):
        merge_lora_ref_(*args, sign=0)
    bad = {
        "weight": (g.weight.transpose(1, 2).contiguous().transpose(1, 2), 0),
        "lora_a": (g.lora_a[..., :16], 1),
        "lora_b": (g.lora_b[:, :1], 2),
        "slot": (2, 3),
        "ranks": (g.ranks.long(), 4),
        "scales": (g.scales.double(), 5),
        "slice_offsets": ([0, 16, 30], 6),
    }
    for name, (value, pos) in bad.items():
        broken = list(args)
        broken[pos] = value
        with pytest.raises(ValueError, match=name):
            merge_lora_(*broken)
    with pytest.raises(ValueError, match=r"slot must be in \[0, 2\)"):
        merge_lora_(*args[:3], -1, *args[4:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_fused_qkv_real_width(dtype):
    # Qwen2-VL-7B-like q|k|v (3584 | 512 | 512) x 3584, four layers, a rank-64 pool, slot in the middle
    ranks = [[64, 16, 1, 64], [0, 16, 1, 33], [64, 16, 1, 5]]
    g = make_group(4, [3584, 512, 512], 3584, 64, ranks, dtype, device="cuda", seed=6)
    original = g.weight.clone()
    for slot in range(4):
        expected = fp32_expected(g, slot)
        run_merge(g, slot)
        assert rel_err(g.weight, expected) < REL_TOL[dtype]
        unmerge_lora_(g.weight, g.lora_a, g.lora_b, slot, g.ranks, g.scales, g.slice_offsets)
        assert rel_err(g.weight, original.float()) < 2 * REL_TOL[dtype]
        g.weight.copy_(original)
