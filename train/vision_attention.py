"""Training-time attention of the Qwen vision towers: one batched call per segment length.

The transformers towers (without flash-attn) split the packed patch sequence at every image,
frame group or window and launch one attention per piece, per layer, forward and backward: with
32 items a step that is hundreds of launches, and pretraining a small model on a GPU waits on
the host. `batch_vision_attention` swaps each vision attention's forward for the same math with
the pieces of one length stacked into one `scaled_dot_product_attention` call (in a batch of
equally sized pictures, one call per layer). Parameters, rotary and outputs are the module's own;
tests check outputs and gradients against the original forward.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F

_ATTENTIONS = ("VisionAttention", "Qwen2_5_VLVisionAttention")


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """q, k, v: [L, H, D] packed pieces of `lengths` (summing to L) -> [L, H, D], each piece
    attending only within itself."""
    total, heads, dim = q.shape
    if len(set(lengths)) == 1:  # the common case: no gather, one call
        n, s = len(lengths), lengths[0]
        q, k, v = (t.reshape(n, s, heads, dim).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(total, heads, dim)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    out = q.new_zeros(total, heads, dim)
    for s in sorted(set(lengths)):
        rows = torch.cat([torch.arange(a, a + s, device=q.device) for a, n in zip(starts, lengths) if n == s])
        count = rows.numel() // s
        qs, ks, vs = (t.index_select(0, rows).reshape(count, s, heads, dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(count * s, heads, dim)
        out = out.index_copy(0, rows, o)
    return out


def _forward(self, hidden_states, cu_seqlens, rotary_pos_emb=None, position_embeddings=None, **kwargs):
    n = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    if position_embeddings is None:  # releases that pass the rotary angles instead
        emb = torch.cat((rotary_pos_emb, rotary_pos_emb), dim=-1)
        position_embeddings = (emb.cos(), emb.sin())
    rotary = sys.modules[type(self).__module__].apply_rotary_pos_emb_vision  # this release's own
    q, k = rotary(q, k, *position_embeddings)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return self.proj(grouped_attention(q, k, v, lengths).reshape(n, -1))


def batch_vision_attention(model) -> int:
    """Patches every Qwen vision attention module of `model` in place; returns how many.
    Towers on flash-attn (already one varlen call) and other architectures are left alone."""
    if "flash" in str(getattr(getattr(model.config, "vision_config", model.config), "_attn_implementation", "")):
        return 0
    patched = 0
    for module in model.modules():
        if type(module).__name__ in _ATTENTIONS and hasattr(module, "qkv"):
            module.forward = types.MethodType(_forward, module)
            patched += 1
    return patched
