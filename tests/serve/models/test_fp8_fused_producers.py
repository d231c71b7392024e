"""FP8 projections with the Triton backend: the norms before qkv_proj / gate_up_proj and the SiLU-mul
before down_proj write the projections' FP8 input themselves (serve.models.fp8.fuse_quantization),
so a layer quantizes only o_proj's input on its own; the output is the same, byte for byte, as with
every projection quantizing itself; bf16 and the PyTorch path are left as they were."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from vlora_kernels.fp8 import attached_rows
from serve.models import load_model
from serve.models import fp8 as fp8_models

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels compiled, else interpreted


def _flags(lm) -> list[bool]:
    return [f for layer in lm.layers for f in (layer.input_layernorm.fp8_output,
                                                layer.post_attention_layernorm.fp8_output, layer.mlp.fp8_act)]


def _quantizations(fn) -> int:
    """Projections quantizing their input themselves in one call (vlora_kernels/fp8.quantize_rows: the Triton
    kernel on a GPU, the fp8_quantize_rows range of the PyTorch path elsewhere)."""
    cuda = DEV == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        from torch.autograd import DeviceType

        return sum("_quantize_rows_kernel" in e.name for e in prof.events() if e.device_type == DeviceType.CUDA)
    return sum(e.name == "fp8_quantize_rows" for e in prof.events())


def test_fused_producers_write_the_fp8_input_and_change_no_byte(tiny_zoo):
    path = tiny_zoo["qwen2_vl_tiny"]
    model, _ = load_model(path, dtype="bfloat16", device=DEV, attention_backend="triton", quantization="fp8")
    lm = model.language_model
    assert _flags(lm) == [True] * (3 * len(lm.layers))
    layer = lm.layers[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, lm.args.hidden_size, generator=g).to(DEV, torch.bfloat16)
    residual = torch.randn(3, lm.args.hidden_size, generator=g).to(DEV, torch.bfloat16)

    def half_layer():  # the MLP half of a decoder layer: norm, gate_up, SiLU-mul, down
        h, r = layer.post_attention_layernorm(x, residual)
        return layer.mlp(h), r, h

    with torch.no_grad():
        fused_out = half_layer()
        assert attached_rows(fused_out[2]) is not None
        assert _quantizations(half_layer) == 0
        assert fp8_models.fuse_quantization(lm, on=False) == 0 and _flags(lm) == [False] * (3 * len(lm.layers))
        plain_out = half_layer()
        assert attached_rows(plain_out[2]) is None
        assert _quantizations(half_layer) == 2  # gate_up's input and down's input
    for got, want in zip(fused_out, plain_out):
        assert torch.equal(got, want)


def test_bf16_and_the_torch_path_keep_their_kernels(tiny_zoo, monkeypatch):
    path = tiny_zoo["qwen2_vl_tiny"]
    bf16, _ = load_model(path, dtype="bfloat16", attention_backend="triton")
    assert not any(_flags(bf16.language_model))
    torch_fp8, _ = load_model(path, dtype="bfloat16", quantization="fp8")  # the PyTorch norms: not fused
    assert not any(_flags(torch_fp8.language_model))
    monkeypatch.setattr(fp8_models, "FUSE_QUANTIZATION", False)
    unfused, _ = load_model(path, dtype="bfloat16", attention_backend="triton", quantization="fp8")
    assert not any(_flags(unfused.language_model))


def test_the_engine_with_fused_quantization_gives_the_same_logits(tiny_zoo, monkeypatch):
    """Prefill and decode steps through the engine (Triton attention and norms; the interpreter on the CPU)."""
    from serve import Engine, EngineConfig, Request, SamplingParams

    monkeypatch.setattr(fp8_models, "ALLOW_CPU", True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs = {}
        for fuse in (True, False):
            monkeypatch.setattr(fp8_models, "FUSE_QUANTIZATION", fuse)
            engine = Engine(tiny_zoo["qwen2_vl_tiny"], EngineConfig(
                device=DEV, dtype="bfloat16", quantization="fp8", attention_backend="triton", num_kv_blocks=64,
                enable_prefix_cache=False, cuda_graphs=False))
            assert _flags(engine.model.language_model) == [fuse] * (3 * len(engine.model.language_model.layers))
            # two tokens: the prefill's and one decode step's (each step runs the interpreter)
            params = SamplingParams(max_tokens=2, ignore_eos=True, keep_logits=True, detokenize=False)
            outs[fuse] = engine.generate([Request(prompt=p, sampling=params) for p in ("a red car", "two dogs")])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids and len(a.logits) == 2
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def _decoder(num_heads: int, num_kv_heads: int, head_dim: int):
    from serve.models.args import ModelArgs
    from serve.models.decoder import DecoderModel

    args = ModelArgs(arch="qwen2_vl", hidden_size=256, num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, intermediate_size=512, vocab_size=64, rms_norm_eps=1e-6, rope_theta=1e4,
                     tie_word_embeddings=True, attention_bias=True, max_position_embeddings=256, image_token_id=1,
                     mrope_section=(head_dim // 8, head_dim // 8 * 3 // 2, head_dim // 8 * 3 // 2))
    lm = DecoderModel(args, backend="triton", dtype=torch.bfloat16)
    fp8_models.quantize_projections(lm)
    return lm


def test_the_decode_attention_writes_o_proj_rows_only_where_a_kv_head_group_is_whole_gemm_tiles(monkeypatch):
    """2 heads of 64 a kv head group: 128 columns, one K tile of the decode GEMM, so the attention writes o_proj's
    FP8 rows; groups of 64 columns (the tiny zoo's) or FUSE_ATTENTION_ROWS off: o_proj quantizes its input."""
    lm = _decoder(4, 2, 64)
    assert all(layer.attn.attn.fp8_output for layer in lm.layers)
    assert not any(layer.attn.attn.fp8_output for layer in _decoder(4, 4, 32).layers)
    monkeypatch.setattr(fp8_models, "FUSE_ATTENTION_ROWS", False)
    assert not any(layer.attn.attn.fp8_output for layer in _decoder(4, 2, 64).layers)
    assert fp8_models.fuse_quantization(lm, on=False) == 0
    assert not any(layer.attn.attn.fp8_output for layer in lm.layers)


def test_rows_attached_to_the_attention_output_reach_o_proj_through_its_reshape():
    """decoder.Attention reshapes [T, H, D] to [T, H * D] (a new tensor object): the rows follow, and o_proj (FP8,
    on the CPU: the dequantized product) multiplies them, not a per-token quantization of its input."""
    from vlora_kernels.fp8 import attach_rows, attached_rows, dequantize, fp8_linear, quantize_rows_ref
    from serve.models.decoder import _rows_kept

    g = torch.Generator().manual_seed(1)
    o = torch.randn(3, 4, 64, generator=g).to(torch.bfloat16) * torch.tensor([1e-4, 1e-4, 100, 100])[None, :, None]
    q, s = quantize_rows_ref(o.reshape(6, 128))
    attach_rows(o, q.reshape(3, 256), s.reshape(3, 2))
    view = _rows_kept(o, o.reshape(3, 256))
    assert attached_rows(view) is not None and attached_rows(o.reshape(3, 256)) is None
    assert _rows_kept(o.clone(), view) is view  # nothing attached: the view as it is
    w = torch.randn(32, 256, generator=g)
    w[:, 128:] = 0  # the product reads the small heads only
    q_w, s_w = fp8_models.quantize_weight(w)
    want = (q.float() * s).reshape(3, 256) @ dequantize(q_w, s_w).T
    exact = o.reshape(3, 256).float() @ w.T
    torch.testing.assert_close(fp8_linear(view, q_w, s_w).float(), want, rtol=2 ** -8, atol=1e-6)
    # per token instead: e4m3 spans 2**-9..448, so the small heads (1e-6 of the large) mostly round to 0
    per_token = fp8_linear(o.reshape(3, 256), q_w, s_w).float()
    assert (per_token - exact).abs().mean() > 10 * (want - exact).abs().mean()
