"""The decoder-only language model shared by Qwen2-VL / Qwen2.5-VL (Qwen2) and LLaVA-1.5 (Llama).

Tokens of all sequences of a step are flattened into one row dimension (`x: [T, D]`); the
paged attention layer reads the sequence boundaries and cache layout from the step context.
Qwen2 and Llama differ here only in the q/k/v bias and in 1-D versus M-RoPE positions.
RoPE's cos/sin are computed once per forward; layers pass the residual stream separately so
the residual add fuses into the next norm. With the "triton" backend (GPU) norms and RoPE are
single Triton kernels (`fused.py`); the PyTorch path computes the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from serve.forward.attention import PagedAttention
from serve.forward.context import get_context

from .args import ModelArgs
from .layers import Embedding, Linear, RMSNorm, silu_and_mul
from .rope import RotaryEmbedding, apply_rotary

# name of each projection slot in a decoder layer -> attribute path (see layers.py for slices)
PROJECTIONS = {"qkv_proj": "attn.qkv_proj", "o_proj": "attn.o_proj",
               "gate_up_proj": "mlp.gate_up_proj", "down_proj": "mlp.down_proj"}


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int, backend: str, dtype, device):
        super().__init__()
        self.args = args
        self.qkv_proj = Linear(args.hidden_size, (args.q_size, args.kv_size, args.kv_size),
                               ("q_proj", "k_proj", "v_proj"), bias=args.attention_bias, dtype=dtype,
                               device=device, layer_index=layer_index)
        self.o_proj = Linear(args.q_size, (args.hidden_size,), ("o_proj",), dtype=dtype, device=device,
                             layer_index=layer_index)
        self.attn = PagedAttention(args.num_heads, args.num_kv_heads, args.head_dim, backend)
        self.fused = backend == "triton"
        self.reduce_output = None  # tensor parallel: sums the ranks' partial outputs (serve.models.parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = self.args
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        t = qkv.shape[0]
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = q.view(t, a.num_heads, a.head_dim)  # strided views into qkv
        k = k.view(t, a.num_kv_heads, a.head_dim)
        v = v.view(t, a.num_kv_heads, a.head_dim)
        if self.fused and self.attn.k_cache is not None:  # rotations and the cache's writes in one launch
            from .fused import rope_store

            q = rope_store(q, k, v, cos, sin, self.attn.k_cache, self.attn.v_cache, get_context().slot_mapping)
            o = self.attn.attend(q)  # [T, H, D]
        else:
            if self.fused:  # no cache yet (the memory profile's dense attention)
                from .fused import rope

                q, k = rope(q, cos, sin), rope(k, cos, sin)
            else:
                q, k = apply_rotary(q, cos, sin).contiguous(), apply_rotary(k, cos, sin).contiguous()
            o = self.attn(q, k, v)  # [T, H, D]
        out = self.o_proj(_rows_kept(o, o.reshape(t, a.q_size)))  # row-parallel under tensor parallel: a partial sum,
        return out if self.reduce_output is None else self.reduce_output(out)  # LoRA's part included


def _rows_kept(o: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """view, carrying the FP8 rows the decode attention attached to o (a reshape is a new tensor object)."""
    if not o.__dict__:  # the common case: nothing attached, and no import on the step's path
        return view
    from vlora_kernels.fp8 import attach_rows, attached_rows

    rows = attached_rows(o)
    return view if rows is None else attach_rows(view, *rows)


def _fp8_rows_wanted(x: torch.Tensor) -> bool:
    """Whether the FP8 projection after x's producer reads its FP8 rows (at decode sizes the FP8 GEMM may
    take the bf16 activation as it is: vlora_kernels/fp8.py `rows_wanted`)."""
    from vlora_kernels.fp8 import rows_wanted

    return rows_wanted(x)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int, dtype, device, fused: bool = False):
        super().__init__()
        self.fused = fused  # the Triton silu-and-multiply (GPU) instead of two eager kernels
        self.fp8_act = False  # FP8 down_proj: the fused kernel also writes the FP8 rows (serve/models/fp8.py)
        i = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, (i, i), ("gate_proj", "up_proj"), dtype=dtype,
                                   device=device, layer_index=layer_index)
        self.down_proj = Linear(i, (args.hidden_size,), ("down_proj",), dtype=dtype, device=device,
                                layer_index=layer_index)
        self.reduce_output = None  # tensor parallel: sums the ranks' partial outputs (serve.models.parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused and self.fp8_act and _fp8_rows_wanted(gate_up):
            from vlora_kernels.fp8_fused import silu_mul_fp8

            act = silu_mul_fp8(gate_up)
        elif self.fused:
            from .fused import silu_and_mul as fused_silu_and_mul

            act = fused_silu_and_mul(gate_up)
        else:
            act = silu_and_mul(gate_up)
        out = self.down_proj(act)  # row-parallel: a partial sum
        return out if self.reduce_output is None else self.reduce_output(out)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_index: int, backend: str, dtype, device):
        super().__init__()
        fused = backend == "triton"
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device, fused)
        self.attn = Attention(args, layer_index, backend, dtype, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device, fused)
        self.mlp = MLP(args, layer_index, dtype, device, fused)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor):
        """(x, residual) -> (this layer's MLP output, the residual stream before it); the caller
        adds the two in the next norm (HF's `residual + x`, in the same order)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.attn(h, cos, sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head of the language side."""

    def __init__(self, args: ModelArgs, backend: str = "torch", dtype=torch.float32, device=None, tp=None):
        """tp: a parallel.TPGroup: each layer holds only this rank's shard, allocated after it was cut on
        the meta device (parallel.allocated_shard); `args` stay the whole model's (finish_shard sets the
        local ones)."""
        super().__init__()
        self.args = args
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size, dtype, device)
        self.rope = RotaryEmbedding(args.head_dim, args.rope_theta, args.mrope_section, device=device)
        self.layers = nn.ModuleList(self._layer(args, i, backend, dtype, device, tp) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, device, backend == "triton")
        self.lm_head = (None if args.tie_word_embeddings else
                        nn.Parameter(torch.empty(args.vocab_size, args.hidden_size, dtype=dtype, device=device),
                                     requires_grad=False))
        self.lm_head_fp8 = self.lm_head_scale = None  # FP8 weight and per-row scales, when quantize_lm_head ran

    @staticmethod
    def _layer(args: ModelArgs, index: int, backend: str, dtype, device, tp) -> "DecoderLayer":
        if tp is None:
            return DecoderLayer(args, index, backend, dtype, device)
        from .parallel import allocated_shard, local_args

        return allocated_shard(lambda where: DecoderLayer(args, index, backend, dtype, where), tp,
                               local_args(args, tp.world_size), device)

    def embed(self, input_ids: torch.Tensor, mm_embeds: torch.Tensor | None = None,
              mm_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: [T]; mm_embeds: [M, D] written (in order) at the M rows where mm_mask [T] is set."""
        x = self.embed_tokens(input_ids)
        if mm_embeds is not None and mm_embeds.shape[0]:
            x = x.masked_scatter(mm_mask[:, None], mm_embeds.to(x.dtype))
        return x

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, D] input embeddings; positions: [T] or [3, T] -> final hidden states [T, D]."""
        cos, sin = self.rope.cos_sin(positions, x.dtype)  # [T, head_dim] each, shared by all layers
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin)
        return self.norm(x, residual)[0]

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [vocab, hidden]: the embedding table when the checkpoint ties them."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_fp8 is not None:  # the head's FP8 copy (serve/models/fp8.py quantize_lm_head)
            from vlora_kernels.fp8 import fp8_linear

            return fp8_linear(hidden, self.lm_head_fp8, self.lm_head_scale)
        return torch.nn.functional.linear(hidden, self.head_weight())

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.attn.attn for layer in self.layers]

    def projections(self) -> Iterator[tuple[int, str, nn.Module]]:
        """(layer index, projection name, module) of every projection hook point."""
        for i, layer in enumerate(self.layers):
            for name, path in PROJECTIONS.items():
                yield i, name, layer.get_submodule(path)

    def set_projection(self, layer_index: int, name: str, module: nn.Module) -> None:
        """Replaces one projection (e.g. by a LoRA-wrapped one); the forward calls whatever is there."""
        if name not in PROJECTIONS:
            raise KeyError(f"unknown projection {name!r}; known: {sorted(PROJECTIONS)}")
        parent_path, attr = PROJECTIONS[name].rsplit(".", 1)
        setattr(self.layers[layer_index].get_submodule(parent_path), attr, module)
