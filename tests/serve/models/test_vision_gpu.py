"""GPU: our Qwen towers at full shape in bf16 against transformers, with no host syncs; device pixels
and nvJPEG against the CPU path. Random weights of the zoo's full-size specs (no download)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

# a 448^2 camera chunk of 6 frames (3 frame groups), a 333 x 500 photo's grid, an odd small clip
GRIDS = [(1, 32, 32)] * 3 + [(1, 24, 36), (3, 4, 6)]


def _towers(name):
    from zoo.build import build_tokenizer_and_ids
    from zoo.configs import hf_config
    from zoo.specs import get_spec

    from bench.vision import towers

    spec = get_spec(name)
    torch.manual_seed(0)
    return towers(hf_config(spec, build_tokenizer_and_ids(spec)[1]).vision_config, spec.arch, "cuda", torch.float32)


@pytest.mark.parametrize("name", ["qwen2_vl_7b", "qwen2_5_vl_7b"])
def test_full_shape_bf16_tower_is_as_close_as_transformers_own_bf16(name):
    reference, ours = _towers(name)
    width = reference.patch_embed.proj.weight[0].numel()
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), width, device="cuda")
    grid = torch.tensor(GRIDS, device="cuda")
    with torch.no_grad():
        truth = reference(pixels, grid_thw=grid)
        truth = getattr(truth, "pooler_output", truth).float()
        reference.to(torch.bfloat16)
        ref_bf16 = reference(pixels.bfloat16(), grid_thw=grid)
        ref_err = float((getattr(ref_bf16, "pooler_output", ref_bf16).float() - truth).norm() / truth.norm())
        ours.to(torch.bfloat16)
        for mode, compiled in (("batched", False), ("varlen", False), ("batched", True)):
            ours.attention, ours.compiled = mode, compiled
            got = ours(pixels.bfloat16(), ours.layout(GRIDS)).float()
            err = float((got - truth).norm() / truth.norm())
            print(f"{name} {mode} compiled={compiled}: ours bf16 {err:.2e}, transformers bf16 {ref_err:.2e}")
            assert err <= 1.5 * ref_err + 1e-3, (mode, compiled, err, ref_err)


def test_tower_step_has_no_host_sync():
    _, ours = _towers("qwen2_5_vl_7b")  # windows of mixed lengths: the gather path too
    ours.to(torch.bfloat16)
    width = ours.patch_embed.proj.weight[0].numel()
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), width, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ours(pixels, ours.layout(GRIDS))  # warm-up (allocator, kernels)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for mode in ("batched", "varlen"):
                ours.attention = mode
                ours(pixels, ours.layout(GRIDS))
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_device_pixels_and_nvjpeg_against_the_cpu_path():
    from serve.models.deferred import Deferred, materialize
    from serve.models.pixels import QwenPixelSpec
    from serve.rpc.wire import encode_frame

    spec = QwenPixelSpec(14, 2, 2, (3136, 1003520), (3136, 1003520), (0.48145466, 0.4578275, 0.40821073),
                         (0.26862954, 0.26130258, 0.27577711))
    level = 1 / (255 * min(spec.std))  # one uint8 level in normalised units
    rng = np.random.default_rng(0)
    same = rng.integers(0, 256, (6, 448, 448, 3), dtype=np.uint8)
    odd = cv2.resize(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8), (500, 333))[None].repeat(5, 0)
    for frames in (same, odd):
        d = Deferred(frames, frames.shape[1:3], spec.video_size(*frames.shape[:3]), spec)
        cpu, gpu = materialize([d], "cpu", torch.float32)[0], materialize([d], "cuda", torch.float32)[0].cpu()
        diff = (cpu - gpu).abs()
        print(f"pixels {frames.shape}: max {diff.max() / level:.2f} levels, mean {diff.mean() / level:.4f}")
        if frames is same:
            assert float(diff.max()) < 1e-5  # no resize: exact
        else:
            assert float(diff.mean()) < 0.5 * level
    # nvJPEG and libjpeg upsample chroma differently: each is held to its error against the frames
    # the JPEGs were made from, not to the other decoder
    source = odd[:2]
    truth = materialize([Deferred(source, (333, 500), spec.video_size(2, 333, 500), spec)], "cpu", torch.float32)[0]
    jpegs = [encode_frame(f, "jpeg")[1] for f in source]
    d = Deferred(jpegs, (333, 500), spec.video_size(2, 333, 500), spec)
    errors = {where: float((materialize([d], where, torch.float32)[0].cpu() - truth).abs().mean()) / level
              for where in ("cpu", "cuda")}
    print(f"jpeg decode mean error against the source frames (levels): {errors}")
    assert errors["cuda"] <= 1.5 * errors["cpu"] + 0.5


def test_full_shape_clip_tower_is_as_close_as_transformers_own_bf16():
    from transformers import CLIPVisionModel
    from zoo.build import build_tokenizer_and_ids
    from zoo.configs import hf_config
    from zoo.specs import get_spec

    from serve.models.clip_vision import ClipVisionTower

    spec = get_spec("llava_1_5_7b")
    config = hf_config(spec, build_tokenizer_and_ids(spec)[1])
    vc = config.vision_config
    torch.manual_seed(0)
    with torch.device("cuda"):
        reference = CLIPVisionModel._from_config(vc, dtype=torch.float32).eval()
        ours = ClipVisionTower(vc, [config.vision_feature_layer]).eval()
    ours.load_state_dict({k.replace("vision_model.", ""): v for k, v in reference.state_dict().items()}, strict=False)
    pixels = torch.randn(8, 3, vc.image_size, vc.image_size, device="cuda")
    with torch.no_grad():
        truth = reference(pixels, output_hidden_states=True).hidden_states[config.vision_feature_layer]
        reference.to(torch.bfloat16)
        ref_bf16 = reference(pixels.bfloat16(), output_hidden_states=True).hidden_states[config.vision_feature_layer]
        from serve.forward import segment_plans

        segment_plans.forget()
        ours.to(torch.bfloat16)
        got = {"varlen": ours(pixels.bfloat16())[0]}  # 8 images: a count this thread has not planned
        with segment_plans.recording():
            got["batched"] = ours(pixels.bfloat16())[0]
        segment_plans.forget()
    ref_err = float((ref_bf16.float() - truth).norm() / truth.norm())
    for path, out in got.items():
        err = float((out.float() - truth).norm() / truth.norm())
        print(f"clip bf16, {path}: ours {err:.2e}, transformers {ref_err:.2e}")
        assert err <= 1.5 * ref_err + 1e-3, path
    assert not torch.equal(got["varlen"], got["batched"])  # two kernels ran, not one twice


def test_nvjpeg_outputs_never_take_memory_a_queued_kernel_still_uses():
    """nvJPEG writes on a stream of its own: outputs allocated from the compute stream's pool could be
    blocks that kernels still queued there use. With work queued on the compute stream and its
    temporaries freed before it ran, every decode must equal the CPU decode and the queued work its
    own result (serve.models.deferred decodes on a stream of its own)."""
    from serve.models.deferred import _decode
    from serve.rpc.wire import encode_frame

    rng = np.random.default_rng(1)
    jpegs = [encode_frame(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8), "jpeg")[1] for _ in range(6)]
    torch.cuda.synchronize()
    want = _decode(jpegs, torch.device("cuda")).clone()  # nvJPEG on an idle GPU (libjpeg's chroma differs)
    torch.cuda.synchronize()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    expected = (a @ a).float().sum()
    for _ in range(20):
        x = a @ a  # queued; its temporaries freed below while it is still running
        total = x.float().sum()
        del x
        got = _decode(jpegs, torch.device("cuda"))
        assert torch.equal(got, want)  # the decoder is deterministic: any difference is a clobbered frame
        assert torch.allclose(total, expected, rtol=1e-3)


def test_auto_attention_plans_nothing_live_that_the_warm_up_did_not():
    """auto: an equal-length step at a count this thread never ran takes the varlen kernel (no cuDNN
    plan built mid-step); once recorded or swept, the batched call. Bitwise each path's own output."""
    import time

    from serve.forward import segment_plans
    from serve.forward.segments import plan_segments, segment_attention

    segment_plans.forget()
    g = torch.Generator(device="cuda").manual_seed(0)
    heads, dim, length = 16, 80, 1024

    def qkv(count):
        return (torch.randn(count * length, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(3))

    q, k, v = qkv(5)
    seg = plan_segments([length] * 5, "cuda")
    varlen = segment_attention(q, k, v, seg, mode="varlen")
    batched = segment_attention(q, k, v, seg, mode="batched")
    assert torch.equal(segment_attention(q, k, v, seg), varlen)  # count 5 never ran here
    with segment_plans.recording():
        for count in (1, 9):
            segment_attention(*qkv(count), plan_segments([length] * count, "cuda"))
    t0 = time.perf_counter()
    built = segment_plans.sweep()
    print(f"swept {built} attention plans in {time.perf_counter() - t0:.2f} s")
    assert built == 7  # counts 2..8
    assert torch.equal(segment_attention(q, k, v, seg), batched)
    torch.testing.assert_close(varlen, batched, atol=2e-2, rtol=2e-2)
    segment_plans.forget()
